"""DFlash drafting for the shared engine: one draft pass proposes a whole block, verified as a chain.

The drafter keeps, per draft layer, the rotated context K/V of every committed token whose target
states are known: with ``n`` tokens in the sequence those are tokens ``0..n-2`` (the root, the newest
token, has not been through the target yet). Each round it runs ``[root, MASK x (B-1)]`` at positions
``n-1 .. n+B-2`` through the draft once (bidirectional in the block, all committed context visible) and
proposes the B-1 block slots as a chain, exactly as the draft was trained (``blocks.py``). A draft with a
``sliding_window`` narrows what each block row sees of that context itself (``DFlashDraft.forward_blocks``: the
cache's row s is position s), as in training.

- T = 0, or ``sampling="argmax"``: the argmax of each slot (a deterministic chain; at T > 0 the shared
  verifier then uses its deterministic-candidate rule, still lossless).
- T > 0 with ``sampling="sample"``: each slot drawn from its own draft distribution (same temperature /
  top-k / top-p as the target), returned as ``draft_probs`` so the verifier's sampled-chain rule is exact.
  Slots are drawn independently (the draft conditions on masks, not on earlier draws), which the
  min(1, p/q) rule allows: each draw is distributed as its reported q given everything before it.

With ``tree: auto`` the round verifies a prefix of the block, sized by ``decoding.budget``. The length is
decided from the slots' distributions BEFORE any slot is drawn, never from the drawn tokens: at T > 0 a
slot is scored by ``sum_x q(x)^2``, the chance that its draw lands on a token as likely as a second draw
would (the mean of ``q`` at the drawn token). Scoring by the probability of the token actually drawn
would keep likely draws and drop unlikely ones, so a kept slot's token would no longer be distributed as
its reported q and the verifier would over-emit the draft's favourite tokens (with p = (0.5, 0.5),
q = (0.9, 0.1) and a cost curve that keeps only a likely draw, the first token comes out 0.55 / 0.45).

``update`` appends the context K/V of the rows the engine kept (``out.accepted_aux``: the root and the
accepted nodes; the bonus token is next round's root), so a round costs one block pass plus a
projection of the new rows, and no draft state is ever rolled back.
"""

from __future__ import annotations

import torch

from draftlab.decoding.budget import TreeBudget, tree_budget
from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.dflash.block_tree import block_tree, max_nodes
from draftlab.methods.dflash.model import ContextKV, DFlashDraft

SAMPLING = ("sample", "argmax")


class ContextCache:
    """Growable per-layer context K/V ``[L, Hkv, S, hd]`` (batch 1), doubling when it runs out."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, S, hd]
        self.v = torch.zeros_like(self.k)  # [L, Hkv, S, hd]
        self.length = 0

    def append(self, kv: ContextKV) -> None:
        """Add rows: ``kv`` per layer ``(k, v)``, each ``[1, Hkv, n, hd]``."""
        n = kv[0][0].shape[2]
        if self.length + n > self.k.shape[2]:
            cap = max(self.length + n, 2 * self.k.shape[2])
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, grown)
        for i, (k, v) in enumerate(kv):
            self.k[i, :, self.length : self.length + n] = k[0]
            self.v[i, :, self.length : self.length + n] = v[0]
        self.length += n

    def view(self) -> ContextKV:
        """The committed rows of every layer as ``(k, v)`` ``[1, Hkv, S, hd]``."""
        n = self.length
        return [(self.k[i, None, :, :n], self.v[i, None, :, :n]) for i in range(self.k.shape[0])]


class DFlashDrafter(Drafter):
    """Proposes one block per round with a :class:`DFlashDraft` (see the module docstring).

    block_size  slots per round, root included (None: the draft's trained block size; smaller is allowed,
                larger is not: the draft never saw slots past its block).
    sampling    ``"sample"`` (draft-probability chain at T > 0) or ``"argmax"`` (deterministic chain).
    tree        ``fixed``: the whole block every round; ``auto``: the chain's prefix with the most expected
                tokens per second (``decoding.budget``), scored by the cumulative product of the slots'
                scores (argmax: the argmax's probability; sampled: ``sum q^2``). The cut is decided before
                any slot is drawn (see the module docstring), so verification stays exact.
    branching   1: the block as a chain (above). > 1: a tree with up to ``branching`` candidates of each slot
                under every kept node of the slot before (``block_tree``: top-k candidates at T = 0 or with
                ``sampling="argmax"``, siblings drawn without replacement otherwise).
    nodes       draft tokens per tree when ``branching > 1``, root excluded (the cap under ``tree: auto``);
                a chain's size is its block's.
    One drafter serves one sequence at a time: ``reset`` starts the context afresh.
    """

    def __init__(self, draft: DFlashDraft, *, block_size: int | None = None, sampling: str = "sample",
                 tree: str = "fixed", branching: int = 1, nodes: int = 16):
        trained = draft.config.block_size
        self.block_size = int(block_size) if block_size is not None else trained
        if not 2 <= self.block_size <= trained:
            raise ValueError(f"block_size must be in [2, {trained}] (the draft's trained block), got {self.block_size}")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got '{sampling}'")
        if int(branching) < 1 or int(nodes) < 0:
            raise ValueError(f"need branching >= 1 and nodes >= 0, got {branching}, {nodes}")
        self.draft = draft.eval()
        self.sampling = sampling
        self.branching, self.nodes = int(branching), int(nodes)
        self._ctx: ContextCache | None = None
        self.budget = tree_budget(tree)

    @property
    def num_context(self) -> int:
        """Committed tokens whose context K/V the drafter holds (``len(tokens) - 1`` between rounds)."""
        return 0 if self._ctx is None else self._ctx.length

    # ---- what the engine must provide ------------------------------------------------------------------

    def taps(self, target) -> list[int]:
        """The draft's taps, named in ``target``'s layer convention."""
        return self.draft.taps(target)

    def scratch_rows(self, cfg) -> int:
        """The chain: root + ``block_size - 1`` proposals; a tree: root + ``nodes`` (fewer when the full tree
        over the block is smaller)."""
        if self.branching == 1:
            return self.block_size
        return 1 + max_nodes(self.block_size - 1, self.branching, self.nodes)

    # ---- compatibility and context ---------------------------------------------------------------------

    def check_compatible(self, target) -> None:
        """Raise ``ValueError`` naming the field when the draft was not built for ``target``."""
        c, g = self.draft.config, target.geometry
        if c.hidden_size != g.hidden_size or c.vocab_size != g.vocab_size:
            raise ValueError(f"draft hidden_size={c.hidden_size}, vocab_size={c.vocab_size} but the target has "
                             f"{g.hidden_size}, {g.vocab_size}: DFlash shares the target's embedding and LM head")
        bad = [i for i in self.draft.taps(target) if not 0 <= i < g.num_layers]
        if bad:
            raise ValueError(f"draft taps {c.target_layer_ids} ({c.layer_convention}) name layers {bad} that a "
                             f"{g.num_layers}-layer target does not have")

    def _append(self, aux: torch.Tensor) -> None:
        # Context rows for positions [length, length + n) from their tapped target states [n, n_taps*d].
        n, start = aux.shape[0], self._ctx.length
        if n == 0:
            return
        w = self.draft.fc.weight
        positions = torch.arange(start, start + n, device=w.device)  # [n]
        ctx = self.draft.fuse(aux.to(w.device)[None])  # [1, n, d]
        self._ctx.append(self.draft.context_kv(ctx, positions))

    # ---- the drafter protocol --------------------------------------------------------------------------

    @torch.no_grad()
    def reset(self, state: DecodeState) -> None:
        """Check the target, share its embedding / LM head, and project the prompt's context rows."""
        self.check_compatible(state.target)
        if state.accepted_aux is None:
            raise ValueError("DFlashDrafter needs the target's tapped hidden states (the engine captures "
                             "taps(target) at prefill)")
        p = state.accepted_aux.shape[0]
        if len(state.tokens) != p + 1:
            raise ValueError(f"expected prompt + root ({p + 1} tokens) after prefill, got {len(state.tokens)}")
        self.draft.share_target_weights(state.target)
        if self.budget is not None:
            self.budget.bind(state.target)
        c, w = self.draft.config, self.draft.fc.weight
        self._ctx = ContextCache(c.num_layers, c.num_kv_heads, c.head_dim, p + 256, dtype=w.dtype, device=w.device)
        self._append(state.accepted_aux)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree:
        """One block pass: the root plus ``block_size - 1`` proposals as a chain."""
        n = len(state.tokens)
        if self._ctx is None or self._ctx.length != n - 1:
            raise RuntimeError(f"the drafter holds context for {self.num_context} tokens but the sequence has {n} "
                               "(expected n - 1): call reset/update after every engine step")
        bs, c = self.block_size, self.draft.config
        device = self.draft.fc.weight.device
        ids = torch.full((1, bs), c.mask_token_id, dtype=torch.long, device=device)  # [1, bs]
        ids[0, 0] = state.root
        positions = torch.arange(n - 1, n - 1 + bs, device=device)  # [bs]
        if self.budget is not None:
            self.budget.context = n  # the verify pass attends over all of them
        block = self.budget.timed(self._block_pass) if self.budget is not None else self._block_pass
        hidden, logits = block((ids, positions))  # [bs-1, d], [bs-1, V]
        return self._proposal(state, hidden, logits)

    def _proposal(self, state: DecodeState, hidden: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        """The round's tree from the block's slot states ``[bs-1, d]`` and logits ``[bs-1, V]`` (the hook a
        block drafter built on DFlash overrides: a selector, a Markov head)."""
        if self.branching > 1:
            return block_tree(state.root, logits, branching=self.branching, nodes=self.nodes,
                              temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
                              generator=state.generator, sampling=self.sampling, budget=self.budget)
        tokens, probs = self._draw_chain(logits, state)
        return DraftTree.chain(state.root, tokens.cpu(), draft_probs=probs)

    def _draw_chain(self, logits: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draw_block(logits, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
                          generator=state.generator, sampling=self.sampling, budget=self.budget)

    def _block_pass(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions = inputs
        hidden = self.draft.forward_blocks(ids, positions, self._ctx.view(), None, block_size=self.block_size)  # [1, bs, d]
        return hidden[0, 1:], self.draft.logits(hidden[0, 1:])  # [bs-1, d], [bs-1, V]

    @torch.no_grad()
    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        """Append the context rows of the tokens the engine kept (root + accepted nodes)."""
        if self.budget is not None:
            self.budget.observe(len(out.result.path) - 1)
        if out.accepted_aux is not None:
            self._append(out.accepted_aux)


def draw_block(logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None, sampling: str = "sample", budget: TreeBudget | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A round's proposals from a block's slot logits ``[bs-1, V]``: tokens ``[k]`` and, when drawn, the
    distributions they were drawn from ``[k, V]`` (None for an argmax chain). ``k`` is the whole block, or
    with a ``budget`` the prefix it keeps, decided before any slot is drawn (the module docstring says why)."""
    if temperature == 0 or sampling == "argmax":
        if budget is not None:
            logits = logits[: _keep(budget, logits.float().softmax(-1).max(-1).values)]  # scored by the argmax's q
        return logits.argmax(-1), None  # [k]
    probs = logits_to_probs(logits, temperature, top_k, top_p)  # [bs-1, V]
    if budget is not None:
        # Scored by E_{x~q}[q(x)] = sum q^2: a function of q alone, never of the token drawn.
        probs = probs[: _keep(budget, (probs.double() ** 2).sum(-1))]  # [k, V]
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device), None
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return sample(probs, generator), probs  # [k], [k, V]


def _keep(budget: TreeBudget, slot_scores: torch.Tensor) -> int:
    """Slots to verify from per-slot scores ``[bs-1]``: a prefix's path probability is their cumulative product."""
    return budget.choose(slot_scores.double().cumprod(0).cpu(), 0)
