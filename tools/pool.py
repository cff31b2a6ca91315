"""Evaluating many configs on every core, through the decision cache.

Each worker builds its own Engine once from the RuleSet: durable handles live in C and do not
survive pickling, and one Engine per worker keeps its compile cost out of the per-cell cost.
Configs are dealt in index ranges (fork shares the list for free; spawn pickles it once per
worker) and results come back in config order, so every output is byte-for-byte the same
whatever the worker count.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
from typing import Callable, Optional, Sequence

from moerules.config import MoEConfig
from moerules.engine.decide import Engine, evaluator_name
from moerules.tools.decision_cache import DecisionCache, config_key
from moerules.tools.progress import Progress
from moerules.engine.ruleset import RuleSet

Task = Callable[[Engine, MoEConfig], dict]   # module-level, so a spawned worker can import it
_MIN_CHUNK, _MAX_CHUNK = 32, 512
_STATE: dict = {}


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def evaluate_all(task: Task, ruleset: RuleSet, configs: Sequence[MoEConfig], *, evaluator: str = "auto",
                 cache_root=None, workers: Optional[int] = None, progress: Optional[Progress] = None) -> list[dict]:
    """`task(engine, config)` for every config, in order: cached results first, each distinct miss once."""
    cache = DecisionCache(cache_root, ruleset.hash, evaluator_name(evaluator), task.__qualname__)
    keys = [config_key(c) for c in configs]
    known = cache.get_many(set(keys))
    missing = list({k: c for k, c in zip(keys, configs) if k not in known}.items())
    if progress:
        progress.advance(len(configs) - len(missing))
    computed = _map(task, ruleset, evaluator, [c for _, c in missing], workers, progress)
    fresh = {k: value for (k, _), value in zip(missing, computed)}
    cache.put_many(fresh)
    cache.close()
    known.update(fresh)
    return [known[k] for k in keys]


def _map(task: Task, ruleset: RuleSet, evaluator: str, configs: list, workers: Optional[int],
         progress: Optional[Progress]) -> list[dict]:
    workers = max(1, min(workers or cpu_count(), len(configs) // _MIN_CHUNK))
    chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, len(configs) // (workers * 8) or 1))
    bounds = [(start, min(start + chunk, len(configs))) for start in range(0, len(configs), chunk)]
    results: list[dict] = []
    if workers == 1:  # the same init and chunks, in this process: no start-up cost for small jobs
        _init(ruleset, evaluator, task, configs)
        parts = map(_run, bounds)
    else:
        pool = _context().Pool(workers, _worker_init, (ruleset, evaluator, task, configs))
        parts = pool.imap(_run, bounds)
    try:
        for part in parts:
            results += part
            if progress:
                progress.advance(len(part))
    finally:
        _STATE.clear()
        if workers > 1:
            pool.terminate()
    return results


def _context():
    """fork where it is safe: workers then inherit the configs. Forking a process that runs other
    threads (torch starts some) can deadlock a worker on a lock held by a thread it did not
    inherit, and Python 3.12 warns of it; such a process starts its workers from a clean one."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and _threads() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _threads() -> int:
    """Threads of this process, native ones included (Linux), else the Python ones."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return threading.active_count()


def _worker_init(ruleset: RuleSet, evaluator: str, task: Task, configs: list) -> None:
    # A forked worker inherits the parent's heap (every config); each full collection walks it,
    # about 15% of a decision's time. Deciding leaves no reference cycles, so collect rarely.
    gc.set_threshold(50_000, 20, 1000)
    _init(ruleset, evaluator, task, configs)


def _init(ruleset: RuleSet, evaluator: str, task: Task, configs: list) -> None:
    _STATE.update(engine=Engine(ruleset, evaluator), task=task, configs=configs)


def _run(bounds: tuple[int, int]) -> list[dict]:
    engine, task, configs = _STATE["engine"], _STATE["task"], _STATE["configs"]
    return [task(engine, config) for config in configs[bounds[0]:bounds[1]]]
