"""Shared fixtures. Tests never touch a network except PyPI through ``draftlab.assets`` (once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


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


@pytest.fixture(scope="session")
def tiny_target():
    from draftlab.targets import load_target

    return load_target("tiny_random")


@pytest.fixture(scope="session")
def smollm2():
    from draftlab.targets import load_target

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return load_target("asset:smollm2-135m-instruct")
