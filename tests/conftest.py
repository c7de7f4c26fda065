"""Shared fixtures. Tests never touch a network except PyPI through ``draftlab.assets`` (once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels (src/draftlab/kernels/) run on CPU tensors through Triton's interpreter; triton.jit reads this when a kernel
# module is imported, so it is set before anything imports draftlab.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs on parallel workers (pytest-xdist, ``-n auto`` in pyproject.toml). Each worker gets its share
# of the cores, and so do the processes it starts (CLI runs, kill-and-resume jobs): oversubscribed CPU
# threads slow every worker down more than the parallelism gains.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_configure(config):
    # The run's draft store (tests/draft_store.py): made by the process that starts the run, before xdist
    # starts its workers (which inherit the variable), removed by it at the end.
    from tests.draft_store import STORE_ENV

    if not os.environ.get(STORE_ENV):
        import tempfile

        os.environ[STORE_ENV] = tempfile.mkdtemp(prefix="draftlab-test-drafts-")
        config._draftlab_store = os.environ[STORE_ENV]


def pytest_unconfigure(config):
    made = getattr(config, "_draftlab_store", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)
        from tests.draft_store import STORE_ENV

        os.environ.pop(STORE_ENV, None)


@pytest.hookimpl(optionalhook=True)  # only known when pytest-xdist is loaded
def pytest_xdist_auto_num_workers(config):
    # One worker per core, at most four: each loads its own copy of the embedded target, and the suite's
    # longest tests (one model each) leave little for more workers to share.
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    # ``gpu`` tests need CUDA; on a CPU machine they are reported as skipped, never silently passed.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"shared data not found at {SHARED_DATA}: the repository expects ../shared beside it")
    return SHARED_DATA


# Where the tiny target lives, and a local tokenizer directory for machines that cannot fetch the asset: the
# GPU check (experiments/gpu_check) runs the conformance suite with DRAFTLAB_TEST_DEVICE=cuda.
TEST_DEVICE = os.environ.get("DRAFTLAB_TEST_DEVICE", "cpu")
TEST_TOKENIZER = os.environ.get("DRAFTLAB_TEST_TOKENIZER") or None


def pinned_row_kernels(target):
    """The fixtures' targets use a fixed small-row table instead of the one measured at first use: the
    measurement costs whole passes in every worker, and a choice made by timing would make a test's sampled
    tokens depend on the machine's load (both products agree only to rounding). The table alternates the
    two products over the row grid, so every verify-pass check runs both."""
    from draftlab.targets.row_kernels import GEMM, ROW_GRID, WEIGHT_MAJOR, RowKernels

    if hasattr(type(target), "row_kernels"):
        target.row_kernels = RowKernels("table", {str(r): (WEIGHT_MAJOR if i % 2 == 0 else GEMM)
                                                  for i, r in enumerate(ROW_GRID)})
    return target


@pytest.fixture(scope="session")
def tiny_target():
    from draftlab.targets import load_target

    extra = {"tokenizer": TEST_TOKENIZER} if TEST_TOKENIZER else {}
    return pinned_row_kernels(load_target("tiny_random", device=TEST_DEVICE, **extra))


@pytest.fixture(scope="session")
def compiled_tiny_target():
    """The tiny target with ``compile="on"`` (targets/compiled.py): its graphs compile once per worker, a few
    seconds per row bucket, so the tests that decode through them share this one."""
    from draftlab.targets import load_target

    extra = {"tokenizer": TEST_TOKENIZER} if TEST_TOKENIZER else {}
    return pinned_row_kernels(load_target("tiny_random", device=TEST_DEVICE, compile="on", **extra))


@pytest.fixture(scope="session")
def smollm2():
    from draftlab.targets import load_target

    torch.set_num_threads(THREADS)
    return pinned_row_kernels(load_target("asset:smollm2-135m-instruct"))
