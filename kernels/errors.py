"""The one exception a caller of `build_layer` has to handle."""

from __future__ import annotations


class KernelBuildError(RuntimeError):
    """A layer cannot be built: unknown id, unsupported cell, format mismatch or missing package.

    The message always starts with the kernel id so that a log line alone says which
    backend failed and why.
    """

    def __init__(self, kernel_id: str, reason: str):
        self.kernel_id = kernel_id
        self.reason = reason
        super().__init__(f"{kernel_id}: {reason}")
