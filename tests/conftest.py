import os

import pytest
import torch


def _threads() -> int:
    """Threads per test process: LOWMEM_TEST_THREADS, else the CPUs this process may use shared among
    pytest-xdist's workers (``make test`` runs 2: one thread each on 2 CPUs), at most 2."""
    if "LOWMEM_TEST_THREADS" in os.environ:
        return int(os.environ["LOWMEM_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(2, cpus // workers))


# Tests run on CPU with a fixed, small thread count: results must not depend on the machine. The runs
# tests start in other processes (the CLI, torchrun) get the same count: a run resumed in this
# process must compute what the interrupted one computed there, bit for bit (the summation order of
# a convolution's gradient depends on the thread count).
THREADS = _threads()
torch.set_num_threads(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_finish(session):
    """Freeze the heap the imports built (torch, the model libraries, the test modules): a measured
    step's memory tracker collects garbage and walks every object Python tracks to find the live
    tensors (``lowmem.profiler.peak``), and a test process starts with ~610k objects where
    ``python -m lowmem.train`` starts with ~255k. Frozen objects are neither collected nor walked
    (tests/test_any_model.py and test_trainer.py, 2 workers, a Zen 3: 131 s -> 110 s). Tensors made
    at import time are then not counted among a run's "other" tensors; none is a run's. (The
    commands do the same, ``lowmem.profiler.peak.freeze_imports``.)"""
    from lowmem.profiler.peak import freeze_imports

    freeze_imports()
