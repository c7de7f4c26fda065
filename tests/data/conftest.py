"""Shared fixtures for the data tests: the embedded SmolLM2 tokenizer and the public data folder."""

from __future__ import annotations

import copy

import pytest

# ``shared_data`` comes from tests/conftest.py: it fails (never skips) when ../shared/data is missing.


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
