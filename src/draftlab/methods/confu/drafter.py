"""ConFu drafting for the shared engine: an EAGLE-3 drafter, composed, plus contemplate rows and a future token.

Per round (the composed ``Eagle3Drafter`` grows the tree and keeps the draft cache; this class adds the
future):

1. ``propose``: the round's future token (keys/values per draft layer, computed in ``update``) is handed
   to the tree as ``SideKeys`` that every tree node attends to. It never enters the draft cache: the
   future token is not part of the committed draft context; each round brings its own.
2. ``extra_rows``: one contemplate row per tree node joins the verify pass
   (``contemplate.verify_extra_rows``), attending to the soft prompts' keys, which are computed once per
   draft and target (``contemplate.soft_prompt_kv``) and passed as pinned keys. Nothing enters the target
   cache. ``cache_soft_prompts=False`` runs the soft prompts as rows of every pass instead (the reference).
3. ``update``: the contemplate row of the last accepted node (``out.extra.aux``) gives ``f`` and, with
   ``e_f`` from the anchor's features, the next future token. The accepted rows are then appended as in
   EAGLE-3, each seeing the future of its own window (``model.future_visibility``): the new anchor row
   sees the new future, the rows before it the previous one while they are within its window.

``reset`` runs the prefill contemplate row (attached to the last prompt token) with the read-only
``forward_with_grad`` of the target under ``no_grad``, so even the target cache's scratch is untouched.
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import DecodeState, Drafter, ExtraRows, VerifyOutput
from draftlab.decoding.tree import DraftTree
from draftlab.methods.confu.contemplate import contemplate, soft_prompt_kv, verify_extra_rows
from draftlab.methods.confu.model import ConFuDraft
from draftlab.methods.eagle3.drafter import Eagle3Drafter
from draftlab.methods.eagle3.model import SideKeys
from draftlab.targets.cache import PinnedKV

FutureKV = list[tuple[torch.Tensor, torch.Tensor]]


class ConFuDrafter(Drafter):
    """Proposes EAGLE-2 dynamic trees with a :class:`ConFuDraft` and adds contemplate rows to verify passes.

    ``branching`` / ``depth`` / ``nodes`` as for ``Eagle3Drafter`` (``self.tree``, which does the tree
    and the draft cache). A verify pass has ``2 * (nodes + 1)`` rows, plus ``num_soft_prompts`` with
    ``cache_soft_prompts=False`` (``scratch_rows``, which the engine reserves). ``tree: auto`` sizes each
    round's tree as EAGLE-3's does, pricing every node at two verify rows (itself and its contemplate row).
    """

    def __init__(self, draft: ConFuDraft, *, branching: int = 10, depth: int = 5, nodes: int = 60,
                 cache_soft_prompts: bool = True, tree: str = "fixed", dtype=None, head_dtype=None,
                 full_vocab: bool = False):
        if not isinstance(draft, ConFuDraft):
            raise TypeError(f"ConFuDrafter needs a ConFuDraft, got {type(draft).__name__} "
                            "(ConFuDraft.from_eagle3 extends an EAGLE-3 draft)")
        # The tree knobs are EAGLE-3's (conf/method/confu.yaml composes eagle3.yaml): the tree drafter takes them.
        self.tree = Eagle3Drafter(draft, branching=branching, depth=depth, nodes=nodes, tree=tree,
                                  rows_per_node=2, dtype=dtype, head_dtype=head_dtype, full_vocab=full_vocab)
        self.draft = self.tree.draft
        self.cache_soft_prompts = cache_soft_prompts
        self._soft: tuple[tuple[int, int], PinnedKV] | None = None  # ((target, weights version), keys)
        self._future: FutureKV | None = None  # the current round's future token
        self._future_anchor = -1  # its anchor: target position == draft row
        self._next_future: tuple[FutureKV, int] | None = None  # computed from the last verify pass
        self.anchors: list[tuple[int, int]] = []  # (anchor, lag of its [con] key) per round, for inspection

    # ---- what the composed EAGLE-3 drafter already answers -------------------------------------------

    @property
    def nodes(self) -> int:
        return self.tree.nodes

    @property
    def num_committed(self) -> int:
        return self.tree.num_committed

    @property
    def root_logprobs(self) -> torch.Tensor | None:
        return self.tree.root_logprobs

    @property
    def cache(self):
        return self.tree.cache

    def check_compatible(self, target) -> None:
        self.tree.check_compatible(target)

    def taps(self, target) -> list[int]:
        return self.tree.taps(target)

    def scratch_rows(self, cfg) -> int:
        """Rows of the largest verify pass: tree nodes + their contemplate rows (+ soft prompts as rows)."""
        soft = 0 if self.cache_soft_prompts else self.draft.config.num_soft_prompts
        return 2 * (self.nodes + 1) + soft

    # ---- soft prompts and the future token --------------------------------------------------------------

    def soft_prompts(self, target) -> torch.Tensor | PinnedKV:
        """What contemplate rows attend to: the soft prompts' pinned keys (computed once per target and
        weights) or, with ``cache_soft_prompts=False``, the soft prompts themselves (rows of every pass)."""
        soft = self.draft.soft_prompts
        if not self.cache_soft_prompts:
            return soft.to(device=target.device, dtype=target.dtype)
        key = (id(target), soft._version)
        if self._soft is None or self._soft[0] != key:
            self._soft = (key, soft_prompt_kv(target, soft.to(device=target.device, dtype=target.dtype)))
        return self._soft[1]

    def _future_for(self, con_aux: torch.Tensor, anchor_aux: torch.Tensor, anchor: int) -> FutureKV:
        device = self.draft.fc.weight.device
        f = self.draft.future_vector(con_aux.to(device)[None, None])  # [1, 1, d]
        e_f = self.draft.future_embedding(anchor_aux.to(device)[None, None])  # [1, 1, d]
        return self.draft.future_kv(e_f, f, torch.tensor([[anchor]], device=device))  # L x [1, Hkv, 1, hd]

    def _append_side(self, n: int, c: int) -> SideKeys:
        # The futures n new rows (positions c..c+n-1) may see: the previous one for rows still in its
        # window, the new one (anchored at the last row) for the last row only.
        if self._next_future is None:
            raise RuntimeError("no future token for the new rows: the engine must pass extra rows' outputs")
        future, anchor = self._next_future
        if anchor != c + n - 1:
            raise RuntimeError(f"future anchored at {anchor}, but the new rows end at {c + n - 1}")
        # On the draft's device: at reset n is the prompt's length.
        rows = torch.arange(c, c + n, device=self.draft.fc.weight.device)  # [n]
        futures, cols = [future], [rows == c + n - 1]
        if self._future is not None:
            futures.insert(0, self._future)
            cols.insert(0, (rows < c + n - 1) & (rows - self._future_anchor < self.draft.config.future_window))
        kv = [(torch.cat([f[layer][0] for f in futures], 2), torch.cat([f[layer][1] for f in futures], 2))
              for layer in range(len(future))]  # per layer [1, Hkv, P, hd]
        return SideKeys(kv, torch.stack(cols, 1))  # mask [n, P]

    def _commit_future(self) -> None:
        self._future, self._future_anchor = self._next_future
        self._next_future = None

    # ---- the drafter protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def reset(self, state: DecodeState) -> None:
        """Prefill contemplate row at the last prompt token, then the prompt's draft rows (EAGLE-3)."""
        self.check_compatible(state.target)
        aux = state.accepted_aux
        if aux is None:
            raise ValueError("ConFuDrafter needs the target's aux hidden states (the engine captures "
                             "taps(target))")
        p = aux.shape[0]
        lag = 1 if p >= 2 else 0
        con = self.draft.contemplate_embedding(aux[p - 1 - lag].to(self.draft.fc.weight.device))  # [d_t]
        con_aux = contemplate(state.target, state.cache, self.soft_prompts(state.target), con[None, None],
                              torch.tensor([[p - 1]], device=con.device),
                              aux_layer_ids=self.taps(state.target))[0, 0]  # [3*d_t]
        self._future, self._future_anchor = None, -1
        self._next_future = (self._future_for(con_aux, aux[p - 1], p - 1), p - 1)
        self.anchors = [(p - 1, lag)]
        self.tree.start(state, self._append_side(p, 0))
        self._commit_future()

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree:
        """Grow an EAGLE-2 dynamic tree whose nodes all attend to the round's future token."""
        return self.tree.grow(state, SideKeys(self._future))

    @torch.no_grad()
    def extra_rows(self, state: DecodeState, tree: DraftTree) -> ExtraRows:
        """One contemplate row after every tree node, keyed on the last accepted token (+ the soft prompts)."""
        con = self.draft.contemplate_embedding(state.accepted_aux[-1].to(self.draft.fc.weight.device))  # [d_t]
        extra = verify_extra_rows(self.soft_prompts(state.target), con.to(state.target.dtype), tree.parents,
                                  tree.depth, state.cache.length)
        extra.embeds = extra.embeds.to(state.target.dtype)  # joins the target's token embeddings
        return extra

    @torch.no_grad()
    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        """Future token from the last kept node's contemplate row, then the accepted rows (EAGLE-3)."""
        if out.extra is None or out.extra.aux is None:
            raise RuntimeError("ConFuDrafter needs the aux states of its contemplate rows (VerifyOutput.extra)")
        n = out.kept
        if n <= 0:
            self.tree.accept(state, out)
            return
        node = out.kept_path[-1]
        soft = 0 if self.cache_soft_prompts else self.draft.config.num_soft_prompts
        con_aux = out.extra.aux[soft + node]  # [3*d_t]
        anchor = self.tree.num_committed + n - 1
        self._next_future = (self._future_for(con_aux, out.accepted_aux[n - 1], anchor), anchor)
        self.anchors.append((anchor, anchor - self._future_anchor))
        self.tree.accept(state, out, self._append_side(n, self.tree.num_committed))
        self._commit_future()
