"""EAGLE-3 drafting for the shared decoding engine: an EAGLE-2 dynamic tree over a persistent draft KV cache.

Alignment is the one the draft was trained with (``ttt.py``): with target features ``F_t`` (context
``x_0..x_t``), the draft row of target position t consumes ``(Emb(x_{t+1}), F_t)`` at RoPE position t and
predicts ``x_{t+2}``. The draft cache holds one committed row per target position whose features are
known, so with ``n`` tokens in the sequence it holds rows ``0..n-2`` and the last one (which consumes the
root, the newest token) gives the distribution of the token after the root.

Growing the tree is the unrolled test-time loop at the last committed row ``r``: a node at depth k is
TTT step k of row r. It consumes its own token and the output state of the row that proposed it (row r
itself for depth 1, its parent's row otherwise), sits at position ``r + k``, and attends to every
committed row plus its ancestors' rows and itself. Those rows are written to the cache past the
committed length and dropped again at the end of ``propose``; ``update`` then appends the rows of the
accepted tokens, computed from the target's features of the verify pass.

The draft cache is a ``DraftRows``; ``grow`` and ``accept`` take ``SideKeys`` (keys outside the cache the
rows also attend to), which is how a method that extends EAGLE-3 with extra draft inputs (ConFu's future
token) composes this drafter instead of overriding it.
"""

from __future__ import annotations

import torch

from draftlab.decoding.cache import KVCache
from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.tree import DraftTree, FrontierBatch, build_dynamic_tree
from draftlab.methods.eagle3.draft_cache import DraftRows
from draftlab.methods.eagle3.model import Eagle3Draft, SideKeys


class Eagle3Drafter(Drafter):
    """Proposes EAGLE-2 dynamic trees with an EAGLE-3 draft; the engine captures the draft's three taps.

    ``top_k`` is the branching factor and frontier width, ``depth`` the number of tree levels (``depth``
    calls of the expansion, ``depth - 1`` draft forwards per round), ``total_tokens`` the number of
    draft nodes kept (the root excluded), as in ``decoding.tree.build_dynamic_tree``. Candidates are
    chosen by top-k, so the trees are deterministic and sampling stays exact through the shared verifier.

    One drafter serves one sequence at a time: ``reset`` starts the draft cache afresh.
    """

    def __init__(self, draft: Eagle3Draft, *, top_k: int = 10, depth: int = 5, total_tokens: int = 60):
        if top_k < 1 or depth < 0 or total_tokens < 0:
            raise ValueError(f"need top_k >= 1, depth >= 0, total_tokens >= 0; "
                             f"got {top_k}, {depth}, {total_tokens}")
        self.draft = draft.eval()
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.rows = DraftRows(self.draft)

    @property
    def cache_chunk(self) -> int:
        """The draft cache starts this many rows past the prompt and at least doubles when it runs out."""
        return self.rows.chunk

    @cache_chunk.setter
    def cache_chunk(self, rows: int) -> None:
        self.rows.chunk = int(rows)

    # ---- public read-only views -------------------------------------------------------------------------

    @property
    def num_committed(self) -> int:
        """Draft rows committed for the current sequence (one per token before the root)."""
        return self.rows.committed

    @property
    def root_logprobs(self) -> torch.Tensor | None:
        """``[V]`` draft log-probs of the token after the root (``-inf`` outside the draft vocabulary)."""
        return self.rows.root_logprobs

    @property
    def cache(self) -> KVCache | None:
        """The draft KV cache (committed rows ``[0, num_committed)``)."""
        return self.rows.cache

    # ---- compatibility ----------------------------------------------------------------------------------

    def check_compatible(self, target) -> None:
        """Raise ``ValueError`` naming the field when the draft was not built for ``target``'s features.

        The target's own default taps do not matter: the engine captures the draft's (``aux_layers``).
        """
        c = self.draft.config
        g = target.geometry
        if c.target_hidden_size != g.hidden_size:
            raise ValueError(f"draft target_hidden_size={c.target_hidden_size} but the target's hidden_size "
                             f"is {g.hidden_size}: the draft's fc expects 3 x {c.target_hidden_size} features")
        if c.vocab_size != g.vocab_size:
            raise ValueError(f"draft vocab_size={c.vocab_size} but the target's vocab_size is "
                             f"{g.vocab_size}")
        if len(c.aux_layer_ids) != 3:
            raise ValueError(f"draft aux_layer_ids={c.aux_layer_ids}: the draft does not say which 3 target "
                             "hidden states it was trained on")
        converted = self.draft.tapped_layers(target)
        bad = [i for i in converted if not 0 <= i < g.num_layers]
        if bad:
            conv = getattr(target.layer_convention, "value", target.layer_convention)
            raise ValueError(f"draft aux_layer_ids={c.aux_layer_ids} ({c.layer_convention}) name {converted} "
                             f"in the target's '{conv}' convention, but a {g.num_layers}-layer target has no "
                             f"layer {bad} there")

    # ---- the drafter protocol: what the engine must provide ----------------------------------------------

    def aux_layers(self, target) -> list[int]:
        """The draft's three taps, named in ``target``'s layer convention."""
        return self.draft.tapped_layers(target)

    def verify_rows(self, cfg) -> int:
        """Tree nodes of the largest tree: the root plus ``total_tokens`` proposals."""
        return self.total_tokens + 1

    # ---- building blocks (composed by methods that extend EAGLE-3) -----------------------------------------

    def start(self, state: DecodeState, side: SideKeys | None = None) -> None:
        """Check the target, then run the draft over the prompt rows (the last one consumes the root).

        ``side``: keys the prompt rows also attend to (its mask is ``[prompt rows, P]``)."""
        self.check_compatible(state.target)
        if state.accepted_aux is None:
            raise ValueError(f"{type(self).__name__} needs the target's aux hidden states (the engine captures "
                             "aux_layers(target))")
        p = state.accepted_aux.shape[0]
        if len(state.tokens) != p + 1:
            raise ValueError(f"expected prompt + root ({p + 1} tokens) after prefill, "
                             f"got {len(state.tokens)}")
        self.rows.start(p)
        self.rows.append(state.tokens[1:p + 1], state.accepted_aux, side)

    def grow(self, state: DecodeState, side: SideKeys | None = None) -> DraftTree:
        """An EAGLE-2 dynamic tree from the root (``state.tokens[-1]``); every tree row also sees ``side``
        (whose mask, if any, is ignored: the rows of one expansion differ in number)."""
        rows = self.rows
        if len(state.tokens) != rows.num_tokens:
            raise RuntimeError(f"the draft cache accounts for {rows.num_tokens} tokens but the sequence has "
                               f"{len(state.tokens)}: call reset/update after every engine step")
        committed = rows.committed
        device = rows.device
        tree_side = SideKeys(side.kv) if side is not None else None
        max_candidates = 1 + self.top_k + max(self.depth - 1, 0) * self.top_k ** 2
        slot = torch.full((max_candidates,), -1, dtype=torch.long)  # [Cmax] cache row of each candidate
        states: dict[int, torch.Tensor] = {}  # candidate -> its row's output state [d]

        def expand(batch: FrontierBatch) -> torch.Tensor:
            if batch.depth == 0:
                return rows.root_logprobs[None]  # [1, V]
            nodes, parents = batch.node_ids.tolist(), batch.parents.tolist()
            f, c = len(nodes), batch.num_candidates
            hidden = torch.stack([rows.h_last if p == 0 else states[p] for p in parents])  # [F, d]
            # Growing first keeps the slot numbers below valid for the cache the rows are written to.
            rows.reserve(f)
            past = rows.cache.length
            slot[batch.node_ids] = torch.arange(past, past + f)
            mask = torch.zeros(f, past + f, dtype=torch.bool)  # [F, S]
            mask[:, :committed] = True
            written = (slot[:c] >= 0).nonzero().flatten()  # [W] candidates with a provisional row
            mask[:, slot[written]] = batch.ancestor_mask[:, written]
            ids = batch.tokens.to(device)  # [F]
            positions = torch.full((f,), committed - 1 + batch.depth, dtype=torch.long, device=device)  # [F]
            h, logp = rows.run(ids, hidden, positions, mask.to(device), tree_side)  # [F, d], [F, V]
            rows.cache.commit(f)
            for j, node in enumerate(nodes):
                states[node] = h[j]
            return logp

        try:
            return build_dynamic_tree(state.root, expand, top_k=self.top_k, depth=self.depth,
                                      total_tokens=self.total_tokens)
        finally:
            rows.rollback()

    def accept(self, state: DecodeState, out: VerifyOutput, side: SideKeys | None = None) -> int:
        """Append the rows of the kept tokens (accepted nodes + bonus) from the verify pass's features;
        returns how many (``side`` mask: ``[kept, P]``)."""
        rows = self.rows
        rows.rollback()
        # The engine may keep fewer tokens than the path offers (EOS, token budget): only those get rows.
        # Row j consumes kept token j with the features of kept node j (the root first).
        n = out.kept
        if n != len(state.tokens) - rows.num_tokens:
            raise RuntimeError(f"{out.kept} tokens kept but the sequence grew by "
                               f"{len(state.tokens) - rows.num_tokens}: one update per engine round")
        if n > 0:
            start = rows.num_tokens
            rows.append(state.tokens[start:start + n], out.accepted_aux, side)
        return n

    # ---- the drafter protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def reset(self, state: DecodeState) -> None:
        """Check the target, then run the draft over the prompt rows (the last one consumes the root)."""
        self.start(state)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree:
        """Grow an EAGLE-2 dynamic tree from the root (``state.tokens[-1]``)."""
        return self.grow(state)

    @torch.no_grad()
    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        """Append the rows of the kept tokens (accepted nodes + bonus) from the verify pass's features."""
        self.accept(state, out)
