"""The draft's own KV cache for one sequence: committed rows, provisional tree rows, growth.

A feature drafter (EAGLE-3, ConFu, any draft that runs ``forward_step`` over a persistent cache) keeps one
committed draft row per target position whose features are known. With ``n`` tokens in the sequence
those are rows ``0..n-2``; the last one consumes the newest token (the root) and gives the distribution
of the token after it. ``DraftRows`` owns that bookkeeping so drafters only decide *which* rows to run:

- ``step`` computes rows at the cache's scratch slots (left uncommitted: tree rows are dropped again
  with ``rollback``) and returns log-probs over the *draft* vocabulary (``[T, V_d]``, draft-id order);
  ``top_candidates`` picks each row's best ids there and maps only those to target ids;
- ``run`` is the same pass with log-probs over the whole *target* vocabulary (``[T, V]``, ``-inf`` where
  the draft cannot emit): the reference, and what an observer that wraps it sees (``observed``);
- ``append`` commits the rows of newly accepted tokens from their target features; only the last one's
  distribution is computed (``root_draft_logprobs``, and the full-vocabulary view ``root_logprobs``,
  built from it on first read);
- all take optional ``SideKeys``: keys outside the cache the rows also attend to (ConFu's future token),
  so no method has to move committed rows around slots of its own;
- a draft with a ``sliding_window`` needs each cache row's position (committed row i sits at position i, a
  provisional tree row wherever its pass put it): ``slot_positions`` keeps them and every pass hands them to
  ``CacheAttention``, which cuts the keys outside each row's window.

Log-probs over the draft vocabulary are exactly the finite entries of the full-vocabulary ones (those are
``-inf`` outside it, so the softmax over ``V_d`` is the same softmax), hence top-k there picks the same
candidates.
"""

from __future__ import annotations

import torch

from draftlab.decoding.dynamic_tree import TopCandidates
from draftlab.methods.eagle3.model import CacheAttention, SideKeys
from draftlab.targets.cache import KVCache


class DraftRows:
    """Draft KV cache + the state of its last committed row, for a draft with ``forward_step``/``new_cache``.

    chunk       the cache starts this many rows past the prompt and at least doubles when it runs out.
    full_vocab  every row through ``run`` (log-probs over the target vocabulary for every row, the head
                over every appended row): the reference path, as draftlab computed it before ``step``.
    """

    def __init__(self, draft, *, chunk: int = 256, full_vocab: bool = False):
        self.draft = draft
        self.chunk = chunk
        self.full_vocab = full_vocab
        self.cache: KVCache | None = None
        self.committed = 0  # draft rows that belong to the sequence (positions 0..committed-1)
        self.num_tokens = 0  # len(state.tokens) the committed rows account for (committed + 1)
        self.h_last: torch.Tensor | None = None  # [d] output state of the last committed row
        self._root_draft: torch.Tensor | None = None  # [V_d] its log-probs over the draft vocabulary
        self._root_full: torch.Tensor | None = None  # [V] the same over the target vocabulary (lazy)
        self._target_ids = draft.target_ids()  # [V_d]
        self.slot_positions: torch.Tensor | None = None  # [max_length] position of each cache row (windowed drafts)

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    @property
    def observed(self) -> bool:
        """True when ``run`` is wrapped on this object or overridden by a subclass: every row then goes
        through it (the full-vocabulary path), so whoever wrapped it keeps seeing all rows' log-probs."""
        return "run" in vars(self) or type(self).run is not DraftRows.run

    @property
    def reference(self) -> bool:
        """Whether rows take the full-vocabulary path (``full_vocab`` or ``observed``)."""
        return self.full_vocab or self.observed

    # ---- the last committed row's distribution -----------------------------------------------------------

    @property
    def root_draft_logprobs(self) -> torch.Tensor | None:
        """``[V_d]`` fp32 log-probs of the token after the root, over the draft vocabulary (draft-id order)."""
        if self._root_draft is None and self._root_full is not None:
            self._root_draft = self._root_full[self._target_ids]
        return self._root_draft

    @property
    def root_logprobs(self) -> torch.Tensor | None:
        """``[V]`` log-probs of the token after the root over the target vocabulary (``-inf`` outside the
        draft vocabulary); built from ``root_draft_logprobs`` on first read."""
        if self._root_full is None and self._root_draft is not None:
            self._root_full = self.to_full_vocab(self._root_draft[None])[0]
        return self._root_full

    @root_logprobs.setter
    def root_logprobs(self, logp: torch.Tensor | None) -> None:
        self._root_full, self._root_draft = logp, None

    def _set_root(self, draft_logp: torch.Tensor) -> None:
        self._root_draft, self._root_full = draft_logp, None

    # ---- the cache ---------------------------------------------------------------------------------------

    def start(self, prompt_rows: int) -> None:
        """A fresh, empty cache for a sequence whose prompt will need ``prompt_rows`` rows."""
        self._target_ids = self.draft.target_ids()
        self.cache = self.draft.new_cache(1, prompt_rows + self.chunk)
        self.slot_positions = None
        self.committed, self.num_tokens = 0, 1
        self.h_last, self._root_draft, self._root_full = None, None, None

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
        if self.slot_positions is not None:
            positions = torch.arange(grown.max_length, device=self.slot_positions.device)
            positions[:n] = self.slot_positions[:n]
            self.slot_positions = positions

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Record the positions ``[T]`` of the rows a pass writes next and return every row's ``[length + T]``;
        None for a draft without a sliding window (its attention needs no positions)."""
        if getattr(self.draft.config, "sliding_window", None) is None:
            return None
        if self.slot_positions is None:
            # Committed row i is position i (``append``); provisional rows are overwritten as they are written.
            self.slot_positions = torch.arange(self.cache.max_length, device=positions.device)
        past, T = self.cache.length, positions.shape[0]
        self.slot_positions[past:past + T] = positions
        return self.slot_positions[:past + T]

    # ---- draft passes ------------------------------------------------------------------------------------

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None, side: SideKeys | None = None, *,
             logits_rows: slice | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """T rows ``ids [T]`` with inputs ``hidden [T, 3*d_t | d]`` at ``positions [T]``, written at the cache's
        length and left uncommitted; ``mask [T, length + T]`` (default causal). Returns (states [T, d],
        fp32 log-probs over the draft vocabulary [T', V_d]) for the rows ``logits_rows`` (default: all)."""
        self.reserve(ids.shape[0])
        attention = CacheAttention(self.cache, mask, side, self.key_positions(positions))
        h, logits = self.draft.forward_step(ids[None], hidden[None], positions[None], attention,
                                            logits_rows=logits_rows)  # [1, T, d], [1, T', V_d]
        # A bf16 head's weight-major logits are a transposed view: converting into a contiguous fp32
        # tensor is cheap, a softmax over the strided one is not.
        logits = logits[0].to(torch.float32, memory_format=torch.contiguous_format)  # [T', V_d]
        return h[0], torch.log_softmax(logits, dim=-1)

    def run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None, side: SideKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` with log-probs over the target vocabulary: returns (states [T, d], log-probs [T, V])."""
        self.reserve(ids.shape[0])
        attention = CacheAttention(self.cache, mask, side, self.key_positions(positions))
        h, logits = self.draft.forward_step(ids[None], hidden[None], positions[None], attention)  # [1, T, d], [1, T, V_d]
        return h[0], self.full_vocab_logprobs(logits[0])

    def full_vocab_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[T, V_d]`` -> log-probs ``[T, V]`` (``-inf`` where the draft cannot emit)."""
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format)  # as in ``step``
        return self.to_full_vocab(torch.log_softmax(logits, dim=-1))

    def to_full_vocab(self, draft_logp: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary log-probs ``[T, V_d]`` -> ``[T, V]`` (``-inf`` where the draft cannot emit)."""
        # Draft id i predicts target id i + d2t[i]; every other target id is impossible for the draft.
        out = draft_logp.new_full((draft_logp.shape[0], self.draft.config.vocab_size), float("-inf"))  # [T, V]
        out[:, self._target_ids] = draft_logp
        return out

    def top_candidates(self, draft_logp: torch.Tensor, k: int) -> TopCandidates:
        """Each row's ``k`` most probable draft ids (``draft_logp [T, V_d]``) as target ids: ``[T, k]``."""
        values, ids = torch.topk(draft_logp, min(k, draft_logp.shape[-1]), dim=-1)  # [T, k]
        return TopCandidates(values, self._target_ids[ids])

    def append(self, ids: list[int], aux: torch.Tensor, side: SideKeys | None = None) -> None:
        """Commit rows for target positions ``committed .. committed + n - 1`` from their features ``aux [n, .]``."""
        n = len(ids)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [n]
        positions = torch.arange(self.committed, self.committed + n, device=self.device)  # [n]
        if self.reference:
            h, logp = self.run(ids_t, aux.to(self.device), positions, side=side)  # [n, d], [n, V]
            self.root_logprobs = logp[-1]
        else:
            # Only the last row's distribution is ever read: the others skip the head.
            h, logp = self.step(ids_t, aux.to(self.device), positions, side=side,
                                logits_rows=slice(-1, None))  # [n, d], [1, V_d]
            self._set_root(logp[-1])
        self.cache.commit(n)
        self.committed += n
        self.num_tokens += n
        self.h_last = h[-1]

    def rollback(self) -> None:
        """Drop every provisional row (tree rows of the last proposal)."""
        self.cache.truncate(self.committed)
