"""The small training corpus the drafter tests share: the tiny target's own greedy continuations."""

from __future__ import annotations

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate

TRAIN_PROMPTS = [list(range(100, 116)), [5, 6, 7, 8, 9] * 4, list(range(2000, 2040, 3))]
UNSEEN_PROMPT = list(range(3000, 3014))
TRAIN_NEW_TOKENS = 40


def greedy(target, prompt: list[int], n: int) -> list[int]:
    """``prompt`` followed by the target's ``n`` greedy tokens (EOS ignored)."""
    out, _ = autoregressive_generate(target, prompt, GenerationConfig(max_new_tokens=n, stop_on_eos=False))
    return out


def train_sequences(target) -> list[list[int]]:
    """Each training prompt continued greedily by ``target`` for ``TRAIN_NEW_TOKENS`` tokens."""
    return [p + greedy(target, p, TRAIN_NEW_TOKENS) for p in TRAIN_PROMPTS]
