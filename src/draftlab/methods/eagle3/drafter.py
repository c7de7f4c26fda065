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

Every level's frontier rows run in one draft pass, and candidates are chosen inside the draft vocabulary:
log-softmax and top-k over the ``V_d`` head outputs, target ids looked up only for the chosen ids
(``DraftRows.top_candidates``). The full-vocabulary log-probs (``-inf`` outside the draft vocabulary) have
exactly those values at the draft's ids, so the trees are the ones top-k over the target vocabulary grows
(``full_vocab=True`` keeps that reference path; ``root_logprobs`` stays available, built when read).

The draft cache is a ``DraftRows``; ``grow`` and ``accept`` take ``SideKeys`` (keys outside the cache the
rows also attend to), which is how a method that extends EAGLE-3 with extra draft inputs (ConFu's future
token) composes this drafter instead of overriding it.
"""

from __future__ import annotations

import copy

import torch

from draftlab.decoding.budget import tree_budget
from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.dynamic_tree import FrontierBatch, TopCandidates, build_dynamic_tree
from draftlab.decoding.tree import DraftTree
from draftlab.methods.eagle3.draft_cache import DraftRows
from draftlab.methods.eagle3.model import Eagle3Draft, SideKeys
from draftlab.methods.eagle3.outcome_drafter import Eagle3OutcomeDrafter
from draftlab.nn.placement import check_on_target_device
from draftlab.targets.cache import KVCache


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` / None -> a torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(str(dtype), str(dtype)).removeprefix("torch.")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"drafter dtype must be a floating dtype such as 'bfloat16', got {dtype!r}")
    return resolved


def _weights_version(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    # Changes whenever a parameter or buffer is replaced or modified in place (optimiser steps, copy_).
    return tuple((id(t), t._version) for t in module.state_dict(keep_vars=True).values())


class Eagle3Drafter(Drafter):
    """Proposes EAGLE-2 dynamic trees with an EAGLE-3 draft; the engine captures the draft's three taps.

    ``branching`` is the branching factor and frontier width, ``depth`` the number of tree levels (``depth``
    calls of the expansion, ``depth - 1`` draft forwards per round), ``nodes`` the number of
    draft nodes kept (the root excluded), as in ``decoding.dynamic_tree.build_dynamic_tree``. Candidates are
    chosen by top-k, so the trees are deterministic and sampling stays exact through the shared verifier.

    ``dtype`` (e.g. ``"bfloat16"``; None = the draft's own): the draft passes run in a copy of the draft
    cast to it (re-synced from ``draft`` whenever its weights change); ``head_dtype`` casts only the LM head
    of that copy (default: ``dtype``), e.g. a bf16 head on an fp32 draft, since the head is the one matrix
    large enough for bf16 to pay on a CPU (see experiments/engine_baseline, part e). Log-probs and tree
    scores stay fp32; the target and the verifier keep their own precision, so the output distribution is
    unchanged, only the proposals may differ.
    ``full_vocab``: the reference path, every row's log-probs over the whole target vocabulary and top-k
    there (what this drafter did before it worked in the draft vocabulary; same trees, slower).
    ``tree``: ``fixed`` keeps ``nodes`` draft tokens every round; ``auto`` sizes each round's tree (at most
    ``nodes`` nodes, at most ``depth`` levels) for expected tokens per second from the measured verify
    cost of the target and the draft's own scores (``decoding.budget.TreeBudget``, ``self.budget``).

    One drafter serves one sequence at a time: ``reset`` starts the draft cache afresh.
    """

    def __init__(self, draft: Eagle3Draft, *, branching: int = 10, depth: int = 5, nodes: int = 60,
                 dtype: str | torch.dtype | None = None, head_dtype: str | torch.dtype | None = None,
                 full_vocab: bool = False, tree: str = "fixed", rows_per_node: int = 1):
        if branching < 1 or depth < 0 or nodes < 0:
            raise ValueError(f"need branching >= 1, depth >= 0, nodes >= 0; "
                             f"got {branching}, {depth}, {nodes}")
        self.draft = draft.eval()
        self.branching, self.depth, self.nodes = branching, depth, nodes
        own = self.draft.fc.weight.dtype
        self.dtype = _as_dtype(dtype) or own
        self.head_dtype = _as_dtype(head_dtype) or self.dtype
        self._compute, self._synced = self.draft, None
        if self.dtype != own or self.head_dtype != self.draft.lm_head.weight.dtype:
            compute = copy.deepcopy(self.draft).to(self.dtype)
            compute.lm_head.to(self.head_dtype)
            self._compute = compute.eval().requires_grad_(False)
            self._synced = _weights_version(self.draft)
        self.rows = DraftRows(self._compute, full_vocab=full_vocab)
        self.budget = tree_budget(tree, rows_per_node=rows_per_node)
        self._outcome_drafter: Eagle3OutcomeDrafter | None = None

    @property
    def full_vocab(self) -> bool:
        """Reference path: log-probs over the target vocabulary for every row and top-k there."""
        return self.rows.full_vocab

    @full_vocab.setter
    def full_vocab(self, on: bool) -> None:
        self.rows.full_vocab = bool(on)

    @property
    def compute_draft(self) -> Eagle3Draft:
        """The module the draft passes run in: ``draft`` itself, or its copy cast to ``dtype``."""
        return self._compute

    def _sync_compute(self) -> None:
        # The cast copy follows the draft's weights (training between evaluations, a reloaded state dict).
        if self._compute is self.draft:
            return
        version = _weights_version(self.draft)
        if version != self._synced:
            with torch.no_grad():
                for mine, theirs in zip(self._compute.state_dict().values(), self.draft.state_dict().values()):
                    mine.copy_(theirs)
            self._synced = version

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
        """Raise ``ValueError`` naming the field when the draft was not built for ``target``'s features, or
        the device when it is not on the target's (its cache would live there too, and every round's
        features would be copied over).

        The target's own default taps do not matter: the engine captures the draft's (``taps``).
        """
        check_on_target_device(self._compute, target, what=f"the {type(self.draft).__name__}")
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
        converted = self.draft.taps(target)
        bad = [i for i in converted if not 0 <= i < g.num_layers]
        if bad:
            conv = getattr(target.layer_convention, "value", target.layer_convention)
            raise ValueError(f"draft aux_layer_ids={c.aux_layer_ids} ({c.layer_convention}) name {converted} "
                             f"in the target's '{conv}' convention, but a {g.num_layers}-layer target has no "
                             f"layer {bad} there")

    # ---- the drafter protocol: what the engine must provide ----------------------------------------------

    def taps(self, target) -> list[int]:
        """The draft's three taps, named in ``target``'s layer convention."""
        return self.draft.taps(target)

    def scratch_rows(self, cfg) -> int:
        """Tree nodes of the largest tree: the root plus ``nodes`` proposals."""
        return self.nodes + 1

    def outcome_drafter(self, target) -> Eagle3OutcomeDrafter:
        """The draft drafting past the verified rows on its own states (``outcome_drafter.py``): SSD's base. It has
        a cache of its own, so this drafter's rounds are not disturbed."""
        self.check_compatible(target)
        self._sync_compute()
        if self._outcome_drafter is None:
            self._outcome_drafter = Eagle3OutcomeDrafter(self._compute, chunk=self.rows.chunk)
        return self._outcome_drafter

    # ---- building blocks (composed by methods that extend EAGLE-3) -----------------------------------------

    def start(self, state: DecodeState, side: SideKeys | None = None) -> None:
        """Check the target, then run the draft over the prompt rows (the last one consumes the root).

        ``side``: keys the prompt rows also attend to (its mask is ``[prompt rows, P]``)."""
        self.check_compatible(state.target)
        if state.accepted_aux is None:
            raise ValueError(f"{type(self).__name__} needs the target's aux hidden states (the engine captures "
                             "taps(target))")
        p = state.accepted_aux.shape[0]
        if len(state.tokens) != p + 1:
            raise ValueError(f"expected prompt + root ({p + 1} tokens) after prefill, "
                             f"got {len(state.tokens)}")
        self._sync_compute()
        if self.budget is not None:
            self.budget.bind(state.target)
        self.rows.start(p)
        self.rows.append(state.tokens[1:p + 1], state.accepted_aux, side)

    def grow(self, state: DecodeState, side: SideKeys | None = None) -> DraftTree:
        """An EAGLE-2 dynamic tree from the root (``state.tokens[-1]``); every tree row also sees ``side``
        (whose mask, if any, is ignored: the rows of one expansion differ in number).

        Each level's frontier rows run in one draft pass; top-k happens in the draft vocabulary and only the
        chosen ids are mapped to target ids (``DraftRows.top_candidates``), unless the rows take the
        full-vocabulary reference path (``full_vocab``, or a wrapped ``DraftRows.run``)."""
        rows = self.rows
        if len(state.tokens) != rows.num_tokens:
            raise RuntimeError(f"the draft cache accounts for {rows.num_tokens} tokens but the sequence has "
                               f"{len(state.tokens)}: call reset/update after every engine step")
        committed = rows.committed
        device = rows.device
        reference = rows.reference
        tree_side = SideKeys(side.kv) if side is not None else None
        max_candidates = 1 + self.branching + max(self.depth - 1, 0) * self.branching ** 2
        # Host bookkeeping, like the tree's own (tree-sized): the cache row of each candidate.
        slot = torch.full((max_candidates,), -1, dtype=torch.long)  # [Cmax]
        # Output state of each expanded candidate's row (candidate 0, the root: the last committed row).
        states = rows.h_last.new_empty(max_candidates, rows.h_last.shape[-1])  # [Cmax, d]
        states[0] = rows.h_last

        def expand(batch: FrontierBatch) -> torch.Tensor | TopCandidates:
            if batch.depth == 0:
                if reference:
                    return rows.root_logprobs[None]  # [1, V]
                return rows.top_candidates(rows.root_draft_logprobs[None], self.branching)  # [1, k]
            f, c = batch.node_ids.shape[0], batch.num_candidates
            hidden = states[batch.parents.to(device)]  # [F, d] the rows that proposed the frontier
            # Growing first keeps the slot numbers below valid for the cache the rows are written to.
            rows.reserve(f)
            past = rows.cache.length
            slot[batch.node_ids] = torch.arange(past, past + f)
            # Built on the draft's device: only the tree-sized part (the provisional rows) comes from the host,
            # not a row of the whole context per level.
            mask = torch.zeros(f, past + f, dtype=torch.bool, device=device)  # [F, S]
            mask[:, :committed] = True
            written = (slot[:c] >= 0).nonzero().flatten()  # [W] candidates with a provisional row
            mask[:, slot[written].to(device)] = batch.ancestor_mask[:, written].to(device)
            ids = batch.tokens.to(device)  # [F]
            positions = torch.full((f,), committed - 1 + batch.depth, dtype=torch.long, device=device)  # [F]
            if reference:
                h, out = rows.run(ids, hidden, positions, mask, tree_side)  # [F, d], [F, V]
            else:
                h, logp = rows.step(ids, hidden, positions, mask, tree_side)  # [F, d], [F, V_d]
                out = rows.top_candidates(logp, self.branching)  # [F, k]
            rows.cache.commit(f)
            states[batch.node_ids.to(device)] = h
            return out

        if self.budget is not None:
            self.budget.context = len(state.tokens)  # the verify pass attends over all of them
        try:
            return build_dynamic_tree(state.root, expand, branching=self.branching, depth=self.depth,
                                      nodes=self.nodes, budget=self.budget)
        finally:
            rows.rollback()

    def accept(self, state: DecodeState, out: VerifyOutput, side: SideKeys | None = None) -> int:
        """Append the rows of the kept tokens (accepted nodes + bonus) from the verify pass's features;
        returns how many (``side`` mask: ``[kept, P]``)."""
        rows = self.rows
        rows.rollback()
        if self.budget is not None:
            self.budget.observe(len(out.result.path) - 1)
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
