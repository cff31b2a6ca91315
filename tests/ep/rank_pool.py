"""A persistent pool of gloo ranks for multi-process tests.

Spawning a rank costs seconds (interpreter + torch import), so each test module starts its
ranks once and feeds them cases through queues. Each rank joins one gloo process group
(`init_distributed`, with a short collective timeout so a bug fails in seconds, never hangs)
and runs `fn(*args)` from an importable module; results come back as torch.save bytes.
"""

from __future__ import annotations

import importlib
import io
import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """A rank raised; carries every failing rank's exception type, message and traceback."""

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        super().__init__("\n".join(f"rank {r}: {kind}: {msg}\n{tb}" for r, (kind, msg, tb) in sorted(failures.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world: int, port: int, timeout_s: float, tasks, results) -> None:
    torch.set_num_threads(1)   # the CI machine has 2 cores for up to 4 ranks and pytest
    from moerules.kernels.ep import init_distributed
    try:
        init_distributed(backend="gloo", timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                         world_size=world)
    except Exception as error:  # reported by the first run(): the pool is unusable
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))
        return
    while True:
        task = tasks.get()
        if task is None:
            os._exit(0)   # skip interpreter teardown (gloo's group shutdown waits on peers): seconds per rank
        module, name, args = task
        try:
            value = getattr(importlib.import_module(module), name)(*args)
            results.put((rank, "ok", dumps(value)))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))


class RankPool:
    def __init__(self, world: int, *, timeout_s: float = 30.0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, wait_s: float = 120.0) -> list:
        """fn(*args) on every rank; the results in rank order, or RankFailed naming each failing rank."""
        outcomes = self.outcomes(fn, *args, wait_s=wait_s)
        missing = sorted(set(range(self.world)) - set(outcomes))
        if missing:
            raise AssertionError(f"ranks {missing} sent nothing within {wait_s} s (hung?)")
        failures = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
        if failures:
            raise RankFailed(failures)
        return [outcomes[r][1] for r in range(self.world)]

    def outcomes(self, fn, *args, wait_s: float, answers: int = 0) -> dict[int, tuple[str, object]]:
        """rank -> ("ok", value) or ("error", (type, message, traceback)) for the first `answers` ranks
        (default all) that answered within wait_s each."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        got = {}
        for _ in range(answers or self.world):
            try:
                rank, status, payload = self.results.get(timeout=wait_s)
            except queue.Empty:
                break
            got[rank] = (status, loads(payload) if status == "ok" else payload)
        return got

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()   # only this pool's own children, by handle
                p.join()

