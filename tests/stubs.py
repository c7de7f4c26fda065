"""Stub targets with fixed logits (litgpt-style) for exact accept/reject accounting."""

from __future__ import annotations

import torch

from draftlab.targets.base import Geometry, TargetOutput
from draftlab.targets.cache import KVCache


class TableTarget:
    """A target whose next-token logits depend only on the current token: ``table[token] -> logits [V]``.

    With one-hot-ish rows the greedy continuation of any token is known in advance, so a test can say
    exactly which draft tokens must be accepted.
    """

    def __init__(self, next_token: dict[int, int] | torch.Tensor, vocab_size: int = 16, eos: int | None = None):
        self.vocab_size = vocab_size
        if isinstance(next_token, dict):
            table = torch.full((vocab_size, vocab_size), -10.0)
            for a, b in next_token.items():
                table[a, b] = 10.0
            self.table = table
        else:
            self.table = next_token
        self.geometry = Geometry(1, 4, 1, 1, 4, vocab_size, 4, "stub")
        self.eos_token_ids = [] if eos is None else [eos]
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.calls: list[int] = []  # rows per forward call

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        return KVCache(1, batch_size, 1, 4, max_length)

    def forward(self, input_ids, position_ids=None, cache=None, attn_mask=None, request=None):
        T = input_ids.shape[1]
        if cache is not None:
            cache.reserve(T)
        self.calls.append(T)
        logits = self.table[input_ids]  # [B, T, V]
        if request is not None and request.logits_rows is not None:
            logits = logits[:, request.logits_rows]
        return TargetOutput(logits=logits, aux_hidden=None)
