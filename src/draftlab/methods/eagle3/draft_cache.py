"""The draft's own KV cache for one sequence: committed rows, provisional tree rows, growth.

A feature drafter (EAGLE-3, ConFu, any draft that runs ``forward_step`` over a persistent cache) keeps one
committed draft row per target position whose features are known. With ``n`` tokens in the sequence
those are rows ``0..n-2``; the last one consumes the newest token (the root) and gives the distribution
of the token after it. ``DraftRows`` owns that bookkeeping so drafters only decide *which* rows to run:

- ``run`` computes rows at the cache's scratch slots (left uncommitted: tree rows are dropped again
  with ``rollback``);
- ``append`` commits the rows of newly accepted tokens from their target features;
- both take optional ``SideKeys``: keys outside the cache the rows also attend to (ConFu's future token),
  so no method has to move committed rows around slots of its own.
"""

from __future__ import annotations

import torch

from draftlab.decoding.cache import KVCache
from draftlab.methods.eagle3.model import CacheAttention, SideKeys


class DraftRows:
    """Draft KV cache + the state of its last committed row, for a draft with ``forward_step``/``new_cache``.

    chunk  the cache starts this many rows past the prompt and at least doubles when it runs out.
    """

    def __init__(self, draft, *, chunk: int = 256):
        self.draft = draft
        self.chunk = chunk
        self.cache: KVCache | None = None
        self.committed = 0  # draft rows that belong to the sequence (positions 0..committed-1)
        self.num_tokens = 0  # len(state.tokens) the committed rows account for (committed + 1)
        self.h_last: torch.Tensor | None = None  # [d] output state of the last committed row
        self.root_logprobs: torch.Tensor | None = None  # [V] its log-probs over the target vocabulary
        self._target_ids = draft.target_ids()  # [V_d]

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    def start(self, prompt_rows: int) -> None:
        """A fresh, empty cache for a sequence whose prompt will need ``prompt_rows`` rows."""
        self._target_ids = self.draft.target_ids()
        self.cache = self.draft.new_cache(1, prompt_rows + self.chunk)
        self.committed, self.num_tokens = 0, 1

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` more rows past the cache's length (provisional rows are copied along)."""
        cache = self.cache
        needed = cache.length + rows
        if needed <= cache.max_length:
            return
        grown = self.draft.new_cache(1, max(needed + self.chunk, 2 * cache.max_length))
        n = cache.length
        grown.k[:, :, :, :n] = cache.k[:, :, :, :n]
        grown.v[:, :, :, :n] = cache.v[:, :, :, :n]
        grown.length = n
        self.cache = grown

    def run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None, side: SideKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """T rows ``ids [T]`` with inputs ``hidden [T, 3*d_t | d]`` at ``positions [T]``, written at the cache's
        length and left uncommitted; ``mask [T, length + T]`` (default causal). Returns (states [T, d],
        log-probs over the target vocabulary [T, V])."""
        self.reserve(ids.shape[0])
        h, logits = self.draft.forward_step(ids[None], hidden[None], positions[None],
                                            CacheAttention(self.cache, mask, side))  # [1, T, d], [1, T, V_d]
        return h[0], self.full_vocab_logprobs(logits[0])

    def full_vocab_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[T, V_d]`` -> log-probs ``[T, V]`` (``-inf`` where the draft cannot emit)."""
        # Draft id i predicts target id i + d2t[i]; every other target id is impossible for the draft.
        logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V_d]
        out = logp.new_full((logp.shape[0], self.draft.config.vocab_size), float("-inf"))  # [T, V]
        out[:, self._target_ids] = logp
        return out

    def append(self, ids: list[int], aux: torch.Tensor, side: SideKeys | None = None) -> None:
        """Commit rows for target positions ``committed .. committed + n - 1`` from their features ``aux [n, .]``."""
        n = len(ids)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [n]
        positions = torch.arange(self.committed, self.committed + n, device=self.device)  # [n]
        h, logp = self.run(ids_t, aux.to(self.device), positions, side=side)  # [n, d], [n, V]
        self.cache.commit(n)
        self.committed += n
        self.num_tokens += n
        self.h_last, self.root_logprobs = h[-1], logp[-1]

    def rollback(self) -> None:
        """Drop every provisional row (tree rows of the last proposal)."""
        self.cache.truncate(self.committed)
