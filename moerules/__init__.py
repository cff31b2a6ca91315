"""moerules: declarative fused-MoE backend selection that explains itself and runs.

    from moerules import MoEConfig, decide
    decision = decide(MoEConfig(model={...}, platform={...}))
    print(decision.describe())

The engine (durable-rules, or the reference evaluator) loads lazily, and the kernels
(torch, Triton) only when `build` is called, so deciding needs neither torch nor a GPU.
"""

from moerules.config import MoEConfig
from moerules.decision import Decision, ReasonCode
from moerules.errors import (BackendRejectedError, KernelUnavailableError, MoeRulesError,
                             RuleFileError, RuleSetError, UnknownBackendError)

__version__ = "0.1.0"   # pyproject.toml reads it from here


def decide(config, rules=None, engine: str = "auto") -> Decision:
    """Decide the experts backend and dispatch plan for one MoE layer."""
    from moerules.engine.decide import decide as _decide
    return _decide(config, rules, engine)


def explain(config, rules=None, engine: str = "auto", as_json: bool = False, show_all: bool = False) -> str:
    """The decision for `config` as a readable report (or stable JSON): the ranking, the plan and one
    decisive rejection per component (`show_all`: every rejection, every dispatcher)."""
    from moerules.engine.explain import explain_text
    from moerules.engine.decide import decide as _decide, engine_for
    from moerules.errors import BackendRejectedError as _Rejected
    try:
        decision = _decide(config, rules, engine)
    except _Rejected as error:
        decision = error.decision
    dispatchers = engine_for(rules, engine).ruleset.dispatchers  # the engine decide just used
    return decision.to_json() if as_json else explain_text(decision, dispatchers=dispatchers, show_all=show_all)


def load_rules(path=None):
    """Load and validate a folder of rule files (default: the shipped rule set)."""
    from moerules.engine.loader import load_rules as _load
    return _load(path)


def detect():
    """The current machine as a `Platform` (vendor, arch, kernel packages)."""
    from moerules.tools.detect import detect as _detect
    return _detect()


def build(decision, weights, **kwargs):
    """A runnable MoE layer on the kernels the decision names."""
    from moerules.kernels.builder import build as _build
    return _build(decision, weights, **kwargs)


__all__ = ["MoEConfig", "Decision", "ReasonCode", "decide", "explain", "load_rules", "detect", "build",
           "MoeRulesError", "RuleFileError", "RuleSetError", "UnknownBackendError", "BackendRejectedError",
           "KernelUnavailableError"]
