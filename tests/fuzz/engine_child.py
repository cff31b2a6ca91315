"""The engine side of the fuzz suite, in a process of its own: durable-rules crashes or hangs
the interpreter past its capacities, so nothing here may run inside pytest.

    python engine_child.py   reads one JSON request per line: {"rules": DIR, "configs": [PICKLE_HEX]}
                              and answers one JSON line per request (see `handle`).

One long-lived child serves many cases (start-up and imports cost ~1 s, a case milliseconds).
"""

from __future__ import annotations

import json
import pickle
import sys
import time

from moerules.errors import BackendRejectedError, MoeRulesError
from moerules.engine.decide import Engine
from moerules.engine.loader import load_rules


def outcome(engine: Engine, config) -> dict:
    """A decision (a rejected pin's too) or the typed error; any other exception is named as such."""
    try:
        return {"decision": engine.decide(config, quiet=True).model_dump(mode="json", exclude={"engine"})}
    except BackendRejectedError as error:
        return {"decision": error.decision.model_dump(mode="json", exclude={"engine"})}
    except MoeRulesError as error:
        return {"error": type(error).__name__, "message": str(error)}
    except Exception as error:  # noqa: BLE001 - reported to the parent as a failure
        return {"untyped": f"{type(error).__name__}: {error}"}


def handle(request: dict) -> dict:
    """{"load": "typed"|"untyped", "error": ...} if the rules do not build, else both engines'
    outcomes per config; with the seconds it took."""
    started = time.perf_counter()
    configs = [pickle.loads(bytes.fromhex(text)) for text in request["configs"]]
    try:
        ruleset = load_rules(request["rules"])
        engines = [Engine(ruleset, "durable"), Engine(ruleset, "reference")]
    except MoeRulesError as error:
        return {"load": "typed", "error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - started}
    except Exception as error:  # noqa: BLE001
        return {"load": "untyped", "error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - started}
    results = [[outcome(engine, config) for config in configs] for engine in engines]
    return {"load": "ok", "durable": results[0], "reference": results[1], "seconds": time.perf_counter() - started}


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
