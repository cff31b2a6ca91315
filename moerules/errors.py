"""The errors moerules raises. Each names what is wrong, where, and how to fix it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from moerules.decision import Decision


class MoeRulesError(Exception):
    """Base class: every error moerules raises on purpose."""


class FileError(MoeRulesError):
    """An input file is malformed. Carries file:line:col (line 0: the whole file), a fix hint, and the rule id when known."""

    what = "input file"  # how messages name the kind of file

    def __init__(self, message: str, *, file: str, line: int = 0, col: int = 0,
                 rule: Optional[str] = None, hint: Optional[str] = None):
        self.file, self.line, self.col, self.rule, self.hint = file, line, col, rule, hint
        self.message = message
        where = f"{file}:{line}:{col}" if line else file
        text = f"{where}: " + (f"[{rule}] " if rule else "") + message
        super().__init__(text + (f" ({hint})" if hint else ""))


class RuleFileError(FileError):
    """A rule file is malformed."""

    what = "rule file"


class ConfigFileError(FileError):
    """A config file (YAML/JSON with MoEConfig sections) is malformed or does not validate."""

    what = "config file"


class TableFileError(FileError):
    """A golden table (matrix/decisions/*.txt, conformance.csv) is unreadable or not one moerules wrote."""

    what = "golden table"


class RequestError(MoeRulesError, ValueError):
    """A request that cannot be honoured as given: a device that is not here, a size over a limit.

    Raised before anything is allocated or computed, naming the argument, its value and the fix.
    """


class KernelInputError(MoeRulesError, ValueError):
    """A tensor handed to a layer breaks its contract (shape, dtype, device, layout, id range).

    The message names the argument, what was given and what the layer expects. A ValueError too,
    so callers that caught ValueError before this type existed keep working.
    """


class HFConfigError(MoeRulesError, ValueError):
    """A Hugging Face config.json field moerules cannot map; `field` is its dotted name in config.json."""

    def __init__(self, field: str, message: str, *, source: str = "config.json"):
        self.field, self.source = field, source
        super().__init__(f"{source}: {field}: {message}")


class CheckpointError(MoeRulesError):
    """A checkpoint's tensors are missing, or laid out or quantised in a way moerules does not load."""


class RuleSetError(MoeRulesError):
    """Several rule-file errors found in one load; all are reported, not just the first."""

    def __init__(self, errors: Sequence[RuleFileError]):
        self.errors = list(errors)
        super().__init__(f"{len(self.errors)} error(s) in the rules:\n" + "\n".join(f"  {e}" for e in self.errors))


class UnknownBackendError(MoeRulesError, ValueError):
    """A requested backend name is not declared by the rule set."""

    def __init__(self, name: str, valid: Sequence[str], suggestion: Optional[str] = None):
        self.name, self.valid = name, list(valid)
        hint = f" Did you mean {suggestion!r}?" if suggestion else ""
        super().__init__(f"features.backend={name!r} is not a backend of this rule set.{hint} "
                         f"Valid names: auto, {', '.join(self.valid)}")


class BackendRejectedError(MoeRulesError):
    """The user pinned a backend and the rules reject it; never silently replaced."""

    def __init__(self, decision: "Decision"):
        self.decision = decision
        super().__init__(decision.error)


class EngineError(MoeRulesError):
    """The rule engine failed while evaluating (a rule conflict or an engine fault)."""


class KernelUnavailableError(MoeRulesError):
    """A decision names a kernel that cannot be built here (external package, or not registered)."""
