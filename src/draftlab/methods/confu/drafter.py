"""ConFu drafting for the shared engine: the EAGLE-3 drafter plus contemplate rows and a future token.

Per round (``Eagle3Drafter`` does the tree; this class adds the future):

1. ``propose``: the round's future token (keys/values per draft layer, computed in ``update``) is placed
   in the draft cache right after the committed rows, and every tree node attends to it. It is dropped
   again with the tree's provisional rows: the future token is never part of the committed draft
   context; each round brings its own.
2. ``extra_rows``: the soft prompts and one contemplate row per tree node join the verify pass
   (``contemplate.verify_extra_rows``); they never enter the target cache.
3. ``update``: the contemplate row of the last accepted node (``out.extra.aux``) gives ``f`` and, with ``e_f`` from the
   anchor's features, the next future token. The accepted rows are then appended as in EAGLE-3, each
   seeing the future of its own window (``model.future_visibility``): the new anchor row sees the new
   future, the rows before it the previous one while they are within its window. For that pass both
   futures are written in front of the new rows; the rows are then moved down over them.

``reset`` runs the prefill contemplate row (attached to the last prompt token) with the read-only
``forward_with_grad`` of the target under ``no_grad``, so even the target cache's scratch is untouched.
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import DecodeState, ExtraRows, VerifyOutput
from draftlab.decoding.tree import DraftTree
from draftlab.methods.confu.contemplate import contemplate, verify_extra_rows
from draftlab.methods.confu.model import ConFuDraft
from draftlab.methods.eagle3.drafter import Eagle3Drafter

FutureKV = list[tuple[torch.Tensor, torch.Tensor]]


class ConFuDrafter(Eagle3Drafter):
    """Proposes EAGLE-2 dynamic trees with a :class:`ConFuDraft` and adds contemplate rows to verify passes.

    ``top_k`` / ``depth`` / ``total_tokens`` as for ``Eagle3Drafter``. A verify pass has
    ``2 * (total_tokens + 1) + num_soft_prompts`` rows (``verify_rows``, which the engine reserves).
    """

    def __init__(self, draft: ConFuDraft, *, top_k: int = 10, depth: int = 5, total_tokens: int = 60):
        if not isinstance(draft, ConFuDraft):
            raise TypeError(f"ConFuDrafter needs a ConFuDraft, got {type(draft).__name__} "
                            "(ConFuDraft.from_eagle3 extends an EAGLE-3 draft)")
        super().__init__(draft, top_k=top_k, depth=depth, total_tokens=total_tokens)
        self._future: FutureKV | None = None  # the current round's future token
        self._future_anchor = -1  # its anchor: target position == draft row
        self._next_future: tuple[FutureKV, int] | None = None  # computed from the last verify pass
        self._future_slot: int | None = None  # draft-cache slot of the future while a tree grows
        self.anchors: list[tuple[int, int]] = []  # (anchor, lag of its [con] key) per round, for inspection

    def verify_rows(self, cfg) -> int:
        """Rows of the largest verify pass: tree nodes + their contemplate rows + soft prompts."""
        return 2 * (self.total_tokens + 1) + self.draft.config.num_soft_prompts

    # ---- future token ----------------------------------------------------------------------------------

    def _future_for(self, con_aux: torch.Tensor, anchor_aux: torch.Tensor, anchor: int) -> FutureKV:
        device = self.draft.fc.weight.device
        f = self.draft.future_vector(con_aux.to(device)[None, None])  # [1, 1, d]
        e_f = self.draft.future_embedding(anchor_aux.to(device)[None, None])  # [1, 1, d]
        return self.draft.future_kv(e_f, f, torch.tensor([[anchor]], device=device))  # L x [1, Hkv, 1, hd]

    def _write_future(self, slot: int, future: FutureKV) -> None:
        for layer, (k, v) in enumerate(future):
            self._cache.write(layer, slot, k, v)

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._future_slot is not None and mask is not None:
            # Tree rows: the round's future token sits right after the committed rows.
            mask = mask.clone()
            mask[:, self._future_slot] = True
        return super()._run(ids, hidden, positions, mask)

    def _append_rows(self, ids: list[int], aux: torch.Tensor) -> None:
        # Rows for target positions committed..committed+n-1; the last one is the new anchor.
        if self._next_future is None:
            raise RuntimeError("no future token for the new rows: the engine must pass extra rows' outputs")
        future, anchor = self._next_future
        device = self.draft.fc.weight.device
        n, c = len(ids), self._committed
        if anchor != c + n - 1:
            raise RuntimeError(f"future anchored at {anchor}, but the new rows end at {c + n - 1}")
        self._reserve(2 + n)
        cache = self._cache
        # Slot c: the previous future, slot c + 1: the new one, new rows from c + 2.
        if self._future is not None:
            self._write_future(c, self._future)
        self._write_future(c + 1, future)
        cache.commit(2)
        window = self.draft.config.future_window
        mask = torch.zeros(n, c + 2 + n, dtype=torch.bool)  # [n, S]
        mask[:, :c] = True
        if self._future is not None:
            rows = torch.arange(c, c + n - 1)
            mask[: n - 1, c] = rows - self._future_anchor < window
        mask[n - 1, c + 1] = True
        mask[:, c + 2:] = torch.ones(n, n, dtype=torch.bool).tril()
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)  # [n]
        h, logp = self._run(ids_t, aux.to(device), torch.arange(c, c + n, device=device), mask.to(device))
        cache.truncate(c)
        cache.commit_rows(torch.arange(2, 2 + n))  # the rows move down over the two future slots
        self._committed += n
        self._num_tokens += n
        self._h_last, self._root_logprobs = h[-1], logp[-1]
        self._future, self._future_anchor = future, anchor
        self._next_future = None

    # ---- the drafter protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def reset(self, state: DecodeState) -> None:
        """Prefill contemplate row at the last prompt token, then the prompt's draft rows (EAGLE-3)."""
        self.check_compatible(state.target)
        aux = state.accepted_aux
        if aux is None:
            raise ValueError("ConFuDrafter needs the target's aux hidden states (the engine captures "
                             "aux_layers(target))")
        p = aux.shape[0]
        lag = 1 if p >= 2 else 0
        con = self.draft.contemplate_embedding(aux[p - 1 - lag].to(self.draft.fc.weight.device))  # [d_t]
        con_aux = contemplate(state.target, state.cache, self.draft.soft_prompts, con[None, None],
                              torch.tensor([[p - 1]], device=con.device),
                              aux_layer_ids=self.aux_layers(state.target))[0, 0]  # [3*d_t]
        self._future, self._future_anchor = None, -1
        self._next_future = (self._future_for(con_aux, aux[p - 1], p - 1), p - 1)
        self.anchors = [(p - 1, lag)]
        super().reset(state)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree:
        """Grow an EAGLE-2 dynamic tree whose nodes all attend to the round's future token."""
        committed = self._committed
        self._reserve(1)
        self._write_future(committed, self._future)
        self._cache.commit(1)
        self._future_slot = committed
        try:
            return super().propose(state)
        finally:
            self._future_slot = None
            self._cache.truncate(committed)

    @torch.no_grad()
    def extra_rows(self, state: DecodeState, tree: DraftTree) -> ExtraRows:
        """Soft prompts + one contemplate row after every tree node, keyed on the last accepted token."""
        con = self.draft.contemplate_embedding(state.accepted_aux[-1].to(self.draft.fc.weight.device))  # [d_t]
        extra = verify_extra_rows(self.draft.soft_prompts, con, tree.parents, tree.depth, state.cache.length)
        extra.embeds = extra.embeds.to(state.target.dtype)  # joins the target's token embeddings
        return extra

    @torch.no_grad()
    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        """Future token from the last kept node's contemplate row, then the accepted rows (EAGLE-3)."""
        if out.extra is None or out.extra.aux is None:
            raise RuntimeError("ConFuDrafter needs the aux states of its contemplate rows (VerifyOutput.extra)")
        n = out.kept
        if n > 0:
            node = out.kept_path[-1]
            con_aux = out.extra.aux[self.draft.config.num_soft_prompts + node]  # [3*d_t]
            anchor = self._committed + n - 1
            self._next_future = (self._future_for(con_aux, out.accepted_aux[n - 1], anchor), anchor)
            self.anchors.append((anchor, anchor - self._future_anchor))
        super().update(state, out)
