"""Session-wide gloo rank pools for the EP tests (started once: a rank costs seconds to spawn).

The test process itself runs on one thread while the pools are up: with the ranks on the
same two CPU cores, torch's intra-op threads otherwise spin against each other.
"""

from __future__ import annotations

import pytest
import torch

from rank_pool import RankPool


@pytest.fixture(scope="session")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pool2(one_thread):
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4(one_thread):
    pool = RankPool(4)
    yield pool
    pool.close()
