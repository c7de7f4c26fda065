"""Shared fixtures for the data tests: the embedded SmolLM2 tokenizer and the public data folder."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

# tests/data/conftest.py -> the repo root is parents[2]; the shared folder sits beside the repo.
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public data folder {SHARED_DATA} is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The SmolLM2-135M-Instruct tokenizer (ChatML template), loaded once. Do not mutate it."""
    from transformers import AutoTokenizer

    from draftlab import assets

    return AutoTokenizer.from_pretrained(assets.fetch("smollm2-135m-instruct"))


@pytest.fixture
def fresh_tokenizer(smollm2_tokenizer):
    """A private copy of the SmolLM2 tokenizer for tests that change its template or vocabulary."""
    return copy.deepcopy(smollm2_tokenizer)
