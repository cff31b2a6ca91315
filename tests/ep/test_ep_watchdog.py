"""The watchdog over collectives issued without a host wait (NCCL): it never blocks, forgets what
completed, and names the oldest collective that failed or outlived the timeout."""

from __future__ import annotations

import time

from moerules.kernels.ep.comm import Watchdog


class FakeWork:
    def __init__(self, done: bool, error: Exception | None = None):
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done

    def wait(self):
        if self.error is not None:
            raise self.error


def test_completed_collectives_are_forgotten_and_a_running_one_within_the_timeout_is_fine():
    dog = Watchdog(timeout_s=10)
    now = time.monotonic()
    dog.watch(FakeWork(True), "all_to_all_single", "tokens", now)
    running = FakeWork(False)
    dog.watch(running, "all_to_all_single", "routing", now)
    assert dog.oldest_failure() is None
    running.done = True
    assert dog.oldest_failure() is None and not dog._unfinished


def test_the_oldest_collective_past_the_timeout_is_reported_once():
    dog = Watchdog(timeout_s=0.5)
    began = time.monotonic() - 2
    dog.watch(FakeWork(False), "all_to_all_single", "tokens", began)
    dog.watch(FakeWork(False), "all_to_all_single", "partial outputs", began + 1)
    op, what, when, error = dog.oldest_failure()
    assert (op, what, when, type(error), str(error)) == ("all_to_all_single", "tokens", began, TimeoutError,
                                                         "not complete within the collective timeout")
    assert dog.oldest_failure() is None     # the group is broken now; Comm refuses every later call


def test_a_collective_that_failed_is_reported_with_its_error():
    dog = Watchdog(timeout_s=60)
    began = time.monotonic()
    aborted = RuntimeError("NCCL communicator was aborted")
    dog.watch(FakeWork(True), "all_to_all_single", "tokens", began)
    dog.watch(FakeWork(True, aborted), "all_to_all_single", "routing", began)
    assert dog.oldest_failure() == ("all_to_all_single", "routing", began, aborted)
