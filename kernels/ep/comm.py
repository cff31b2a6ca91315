"""`Comm`: the collectives of expert parallelism over a torch.distributed group, each one bounded.

A peer that raised, died or never reached the same collective makes this rank fail with a
`CollectiveError` (this rank, the collective, the timeout, the fix) instead of hanging:
- gloo (CPU) blocks the host in every collective anyway, so each one is waited on with the
  collective timeout;
- NCCL collectives are never waited on by the host (that cost a host sync per collective): the
  compute stream waits on them, and one watchdog bounds them all. `init_distributed` sets the
  group timeout just above the collective timeout, so NCCL's own watchdog aborts a collective
  that never completes (the GPU stream and any host sync behind it are released), and this
  Comm keeps the unfinished collectives it issued and, at each later collective, raises the
  error for the oldest one that is past the timeout or failed (`check()` does so on demand).
  Collectives replayed from a CUDA graph are bounded by neither (no watchdog sees a replay).
After one failure the group is in an unknown state, so every later call fails at once.

The wire carries FP8 as raw bytes (gloo has no float8 type; NCCL treats bytes the same), and
`trace`, when set to a list, records what each collective moved (tests, benchmarks); a packed
collective records one entry per part it carries.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

TIMEOUT_ENV = "MOERULES_EP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_NCCL_WATCHDOG_MARGIN_S = 5.0
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective of the expert-parallel group failed or timed out on this rank."""


class InconsistentRanksError(CollectiveError):
    """The ranks of the group disagree on what they built or on the shape of a batch.

    Every rank gathers every rank's values, so every rank raises this error with the same message,
    before the exchange whose sizes would disagree (gloo aborts the process on such a mismatch, and
    a disagreement that keeps sizes equal, such as the placement or the weights, gives wrong output)."""


# Width of one fingerprint field on the wire: values longer than this travel as a digest.
_FIELD_BYTES = 40


def resolve_timeout(timeout_s: Optional[float] = None) -> float:
    """The collective timeout in seconds: the argument, else $MOERULES_EP_TIMEOUT_S, else 300."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    return float(timeout_s)


@dataclass(frozen=True)
class WireRecord:
    """One collective as this rank saw it: `bytes_out` is what it sent to other ranks."""

    op: str
    what: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes_out: int


class Comm:
    def __init__(self, group=None, *, timeout_s: Optional[float] = None):
        if not dist.is_initialized():
            raise CollectiveError("torch.distributed is not initialised; call torch.distributed.init_process_group "
                                  "(or moerules.kernels.ep.init_distributed) on every rank before building")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.timeout_s = resolve_timeout(timeout_s)
        self.trace: Optional[list[WireRecord]] = None
        self._failure: Optional[str] = None
        self._host_waits = dist.get_backend(self.group) != "nccl"
        self._watchdog = Watchdog(self.timeout_s)     # NCCL collectives not yet seen complete

    # -- collectives ------------------------------------------------------------------------
    def exchange_counts(self, send_counts: torch.Tensor, *, shape: dict[str, int]) -> list[int]:
        """All-to-all of one int64 count per peer; returns what every peer will send here.

        `shape` (e.g. top_k, row width, dtype code) rides along with each count: every peer must send
        the same, else InconsistentRanksError on every rank, before any payload is exchanged."""
        header = torch.tensor(list(shape.values()), dtype=torch.int64, device=send_counts.device)
        send = torch.cat([send_counts.to(torch.int64)[:, None], header.expand(self.size, -1)], dim=1)
        recv = torch.empty_like(send)
        self._run("all_to_all_single", "counts", lambda: dist.all_to_all_single(
            recv, send, group=self.group, async_op=True))
        self._check_shapes(shape, recv[:, 1:].tolist())
        return recv[:, 0].tolist()

    def agree(self, shape: dict[str, int], device: torch.device, *, what: str, skip: int = 0) -> list[list[int]]:
        """Every rank's `shape` values (all-gathered); InconsistentRanksError unless the ranks agree on all but
        the first `skip` of them."""
        mine = torch.tensor([list(shape.values())], dtype=torch.int64, device=device)
        rows = self.all_gather(mine, what=what).tolist()
        self._check_shapes(dict(list(shape.items())[skip:]), [row[skip:] for row in rows])
        return rows

    def _check_shapes(self, shape: dict[str, int], rows: list[list[int]]) -> None:
        differing = [name for i, name in enumerate(shape) if len({row[i] for row in rows}) > 1]
        if differing:
            per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{n}={row[list(shape).index(n)]}" for n in differing)
                                 for r, row in enumerate(rows))
            raise InconsistentRanksError(f"the {self.size} ranks of the expert-parallel group disagree on the batch "
                                         f"they run ({per_rank}); every rank must run the same layer with the same "
                                         "top_k, hidden size and dtype")

    def check_fingerprint(self, fingerprint: dict[str, str], device: torch.device) -> None:
        """All-gather what each rank built (field -> short text); InconsistentRanksError on every rank if any
        field differs between ranks, naming each differing field with every rank's value."""
        mine = torch.stack([_field_bytes(value) for value in fingerprint.values()]).to(device)
        every = self.all_gather(mine[None], what="layer fingerprint")
        texts = [[bytes(field.tolist()).rstrip(b"\0").decode("utf-8", "replace") for field in rank] for rank in every]
        differing = [i for i in range(len(fingerprint)) if len({rank[i] for rank in texts}) > 1]
        if differing:
            names = list(fingerprint)
            detail = "; ".join(f"{names[i]}: " + ", ".join(f"rank {r} {rank[i] or '-'}" for r, rank in enumerate(texts))
                               for i in differing)
            raise InconsistentRanksError(f"the {self.size} ranks of the expert-parallel group built different layers "
                                         f"({detail}); build every rank from the same decision, placement and global "
                                         "weights (same seed or checkpoint), each with its own shard")

    def all_to_all_equal(self, x: torch.Tensor, *, what: str,
                         parts: Optional[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = None) -> torch.Tensor:
        """[size * C, ...] rows, block r for rank r -> [size * C, ...], block r from rank r (equal splits: no
        sizes cross). `parts` names what a packed row carries (name -> dtype, shape), for the trace."""
        out = torch.empty_like(x)
        if self.trace is not None:
            for name, (dtype, shape) in (parts or {what: (x.dtype, tuple(x.shape))}).items():
                row = (torch.Size(shape[1:]).numel() * dtype.itemsize) if len(shape) > 1 else dtype.itemsize
                self.trace.append(WireRecord("all_to_all_single", name, dtype, tuple(shape),
                                             (self.size - 1) * (x.shape[0] // self.size) * row))
        self._run("all_to_all_single", what, lambda: dist.all_to_all_single(_wire(out), _wire(x), group=self.group,
                                                                            async_op=True))
        return out

    def all_gather(self, x: torch.Tensor, *, what: str) -> torch.Tensor:
        """[n, ...] on every rank (same n) -> [size * n, ...] in rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._record("all_gather", what, x, (self.size - 1) * x.numel() * x.element_size())
        self._run("all_gather", what, lambda: _ALL_GATHER(_wire(out), _wire(x.contiguous()), group=self.group,
                                                          async_op=True))
        return out

    def reduce_scatter(self, x: torch.Tensor, *, what: str) -> torch.Tensor:
        """[size * n, ...] partial sums on every rank -> this rank's [n, ...] block of their sum."""
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._record("reduce_scatter", what, x, (self.size - 1) * out.numel() * x.element_size())
        self._run("reduce_scatter", what, lambda: _REDUCE_SCATTER(out, x.contiguous(), group=self.group,
                                                                  async_op=True))
        return out

    def all_reduce(self, x: torch.Tensor, *, what: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place, and returned. x must be contiguous."""
        self._record("all_reduce", what, x, x.numel() * x.element_size())
        self._run("all_reduce", what, lambda: dist.all_reduce(x, op=op, group=self.group, async_op=True))
        return x

    # -- bounded waiting --------------------------------------------------------------------
    def _run(self, op: str, what: str, start: Callable[[], object]) -> None:
        if self._failure is not None:
            raise CollectiveError(f"rank {self.rank}/{self.size}: {op} ({what}) refused: an earlier collective of "
                                  f"this group failed ({self._failure}); the group's state is unknown, re-create "
                                  "the process group (restart the ranks)")
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self.check()
        began = time.monotonic()
        try:
            work = start()
            if self._host_waits:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                work.wait()                     # the current stream waits; the host does not
                if not capturing:
                    self._watchdog.watch(work, op, what, began)
        except (RuntimeError, dist.DistError) as error:
            self._fail(op, what, began, error)

    def check(self) -> None:
        """Raise CollectiveError for the oldest NCCL collective that failed or is past the timeout (no host wait)."""
        failed = self._watchdog.oldest_failure()
        if failed is not None:
            self._fail(*failed)

    def _fail(self, op: str, what: str, began: float, error: BaseException):
        cause = " ".join(str(error).split())[:300]
        self._failure = f"{op} ({what}): {cause}"
        raise CollectiveError(
            f"rank {self.rank}/{self.size}: {op} of the MoE {what} failed after {time.monotonic() - began:.1f} s "
            f"(collective timeout {self.timeout_s:g} s): {cause}. Another rank of the expert-parallel group "
            f"failed, exited or never reached this collective: look for its error first. If the ranks are "
            f"only slow (first-call compilation, a loaded machine), raise the timeout with ${TIMEOUT_ENV} "
            "or build(..., timeout_s=...)") from error

    def _record(self, op: str, what: str, x: torch.Tensor, bytes_out: int) -> None:
        if self.trace is not None:
            self.trace.append(WireRecord(op, what, x.dtype, tuple(x.shape), bytes_out))


class Watchdog:
    """The collectives a rank issued without waiting, oldest first; polled without blocking."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._unfinished: deque = deque()      # (work, op, what, issued at)

    def watch(self, work, op: str, what: str, began: float) -> None:
        self._unfinished.append((work, op, what, began))

    def oldest_failure(self) -> Optional[tuple[str, str, float, BaseException]]:
        """(op, what, issued at, error) of the oldest collective that failed or outlived the timeout, else None;
        collectives seen complete are forgotten. After a failure nothing is watched any more."""
        while self._unfinished:
            work, op, what, began = self._unfinished[0]
            failure = None
            try:
                done = work.is_completed()
                if done:
                    work.wait()        # complete: returns at once, or raises the collective's error
            except (RuntimeError, dist.DistError) as error:
                done, failure = True, error
            if failure is None and not done and time.monotonic() - began > self.timeout_s:
                failure = TimeoutError("not complete within the collective timeout")
            if failure is not None:
                self._unfinished.clear()
                return op, what, began, failure
            if not done:
                return None
            self._unfinished.popleft()
        return None


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float64)


def batch_shape(x: torch.Tensor, topk_ids: torch.Tensor) -> dict[str, int]:
    """What every rank's batch must share in a token exchange: top_k, the row width and its dtype."""
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    return {"top_k": topk_ids.shape[1], "hidden": x.shape[1], "dtype": code}


def _field_bytes(value: str) -> torch.Tensor:
    """One fingerprint field as _FIELD_BYTES bytes: the text, or the start of its SHA-256 when longer."""
    data = value.encode("utf-8")
    if len(data) > _FIELD_BYTES:
        data = hashlib.sha256(data).hexdigest()[:_FIELD_BYTES].encode()
    return torch.tensor(list(data.ljust(_FIELD_BYTES, b"\0")), dtype=torch.uint8)


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def init_distributed(*, backend: str, timeout_s: Optional[float] = None, **kwargs) -> None:
    """`torch.distributed.init_process_group` bounded by the collective timeout, failing clearly.

    gloo bounds its operations by the group timeout itself. For NCCL the group timeout drives
    the watchdog; it is set a few seconds above the collective timeout, and asynchronous error
    handling defaults to 2 (abort the communicator, keep the process), so a timed-out rank
    raises `Comm`'s error, which says what to do, rather than being torn down silently.
    """
    timeout = resolve_timeout(timeout_s)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        timeout += _NCCL_WATCHDOG_MARGIN_S
    rank = kwargs.get("rank", os.environ.get("RANK", "?"))
    world = kwargs.get("world_size", os.environ.get("WORLD_SIZE", "?"))
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise CollectiveError(f"rank {rank}/{world}: the {backend} process group did not form within {timeout:g} s "
                              f"({' '.join(str(error).split())[:300]}). Every rank must start and reach init: "
                              "check that all ranks launched (torchrun --nproc-per-node N), that they share "
                              f"MASTER_ADDR/MASTER_PORT, or raise ${TIMEOUT_ENV}") from error
