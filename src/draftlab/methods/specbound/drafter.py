"""SpecBound drafting over the target's layer-level cache, and the completion pass that verifies it.

A round's rows sit at the target cache's scratch slots ``past + i`` (row 0 = the root, the last committed
token); ``depth`` counts the layers a row has run, whose K/V are in the cache at its slot. Invariant: a
row attends at layer ``l`` only to rows that already hold layer-``l`` K/V, so every K/V is exact:

- drafting: the newest row runs layers up to the next exit layer; an earlier row still at the newest
  row's depth joins the same call (the layer-parallel catch-up), so the newest row sees it at every layer;
- at each exit layer ``l`` the head's confidence, ``max softmax(z / T_l)`` with ``T_l = 1 + alpha (1 - l/L)``,
  either passes ``tau`` (the head's argmax -- a sample of its distribution at T > 0 -- is the next draft
  token) or not; a token that has not exited by ``d_max`` is difficult and ends the round, as do
  ``w_max`` drafted tokens;
- ``verify_forward`` completes every row through the remaining layers, rows joining as the shallowest
  reach their depth, and returns the final-layer logits of the whole chain: the engine's verifier uses
  them as it uses a full forward. Accepted rows are committed at every layer; rejected rows are beyond the
  cache length and are overwritten by the next round (the rollback).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.decoding.drafter import DecodeState, Drafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.specbound.heads import ExitHeads, act_temperature
from draftlab.nn.placement import check_on_target_device
from draftlab.targets.base import TargetOutput


@dataclass
class _Row:
    token: int
    hidden: torch.Tensor  # [d] residual stream after ``depth`` layers
    depth: int


class SpecBoundDrafter(Drafter):
    """Early-exit self-drafting with ACT and the ``d_max`` / ``w_max`` bounds (see the module docstring).

    heads        trained exit heads (their layers are where a token may exit).
    alpha, tau   ACT slope and confidence threshold.
    d_max        deepest layer a token may exit at (None = the deepest head); deeper = difficult. ``d_max = L``
                 removes the bound (the "-d_max" ablation): a token no head lets exit runs every layer and
                 is drafted from the final layer itself, which the verifier then accepts.
    w_max        most tokens drafted per round.
    """

    def __init__(self, heads: ExitHeads, *, alpha: float = 1.0, tau: float = 0.8, d_max: int | None = None,
                 w_max: int = 6):
        if w_max < 1:
            raise ValueError(f"w_max must be >= 1, got {w_max}")
        self.heads = heads.eval()
        self.alpha, self.tau, self.w_max = float(alpha), float(tau), int(w_max)
        L = heads.config.num_layers
        self.d_max = int(d_max) if d_max is not None else max(heads.exit_layers)
        self.stops = [layer for layer in heads.exit_layers if layer <= self.d_max]
        if not self.stops:
            raise ValueError(f"d_max={self.d_max} is shallower than every exit head {list(heads.exit_layers)}")
        if self.d_max > L:
            raise ValueError(f"d_max={self.d_max} is deeper than the target's {L} layers (d_max = {L}: no bound)")
        self.unbounded = self.d_max == L
        self._rows: list[_Row] = []
        self._past = 0
        self.exit_depths: list[int] = []  # exit layer of every token drafted in this sequence
        self._ends = {"difficult": 0, "width": 0}  # how this sequence's rounds stopped drafting

    def scratch_rows(self, cfg) -> int:
        return self.w_max + 1

    def reset(self, state: DecodeState) -> None:
        self.heads.check_target(state.target)
        # Each head's map meets the target's hidden states (no per-round copy of either).
        check_on_target_device(self.heads, state.target, what="the SpecBound exit heads")
        self._rows = []
        self.exit_depths = []
        self._ends = {"difficult": 0, "width": 0}

    def sequence_stats(self) -> dict[str, float]:
        """Drafted tokens, their mean exit layer and a count per exit layer; rounds ended by a difficult
        token (no exit up to ``d_max``) or by ``w_max``."""
        n = len(self.exit_depths)
        out = {"drafted": n, "mean_exit_layer": sum(self.exit_depths) / n if n else 0.0,
               "rounds_difficult": self._ends["difficult"], "rounds_width": self._ends["width"]}
        for layer in self.stops + ([self.d_max] if self.unbounded else []):
            out[f"exits_l{layer}"] = self.exit_depths.count(layer)
        return out

    # ---- the layer-level passes ---------------------------------------------------------------------

    def _run(self, target, cache, rows: list[int], start: int, end: int) -> None:
        """Layers ``[start, end)`` on ``self._rows[rows]`` (all at depth ``start``), in one call."""
        slots = torch.tensor([self._past + i for i in rows], device=target.device)  # [T]
        S = int(slots.max()) + 1
        mask = torch.arange(S, device=target.device)[None] <= slots[:, None]  # [T, S]: prefix + earlier rows
        h = torch.stack([self._rows[i].hidden for i in rows])[None]  # [1, T, d]
        out = target.forward_layers(h, start, end, position_ids=slots, cache=cache, attn_mask=mask, slots=slots)
        for j, i in enumerate(rows):
            self._rows[i].hidden, self._rows[i].depth = out.hidden[0, j], end

    def _advance(self, target, cache, upto: int, *, newest_only: bool) -> None:
        """Bring the newest row (or, with ``newest_only=False``, every row) to depth ``upto``; rows at the
        depth of the current batch join it, so nothing attends to a layer a row has not computed."""
        while True:
            pending = self._rows if not newest_only else [self._rows[-1]]
            start = min(r.depth for r in pending)
            if start >= upto:
                return
            rows = [i for i, r in enumerate(self._rows) if r.depth == start]
            deeper = [r.depth for r in self._rows if r.depth > start]
            self._run(target, cache, rows, start, min([upto, *deeper]))

    # ---- the round ----------------------------------------------------------------------------------

    def _new_row(self, target, token: int) -> _Row:
        ids = torch.tensor([[token]], device=target.device)
        return _Row(token=token, hidden=target.embed(ids)[0, 0], depth=0)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree:
        target, cache = state.target, state.cache
        L = target.geometry.num_layers
        self._past = cache.length
        self._rows = [self._new_row(target, state.root)]
        tokens, probs = [], []
        while len(tokens) < self.w_max:
            drafted = None
            for layer in self.stops:
                self._advance(target, cache, layer, newest_only=True)
                z = self.heads.logits(target, self._rows[-1].hidden[None, None], layer)[0, 0].float()  # [V]
                if torch.softmax(z / act_temperature(layer, L, self.alpha), -1).max() >= self.tau:
                    drafted = self._draft_token(z, state, probs)
                    self.exit_depths.append(layer)
                    break
            if drafted is None and self.unbounded:  # no depth bound: the final layer drafts the token
                self._advance(target, cache, L, newest_only=True)
                z = target.lm_head(self._rows[-1].hidden[None, None], norm=True)[0, 0].float()  # [V]
                drafted = self._draft_token(z, state, probs)
                self.exit_depths.append(L)
            if drafted is None:
                self._ends["difficult"] += 1
                break  # a difficult token: stop speculating, the completion pass finishes it
            tokens.append(drafted)
            self._rows.append(self._new_row(target, drafted))
        else:
            self._ends["width"] += 1
        if not tokens:
            return DraftTree.chain(state.root, [])
        return DraftTree.chain(state.root, tokens, draft_probs=torch.stack(probs) if probs else None)

    @staticmethod
    def _draft_token(z: torch.Tensor, state: DecodeState, probs: list) -> int:
        """The head's argmax at T = 0; otherwise a sample of its distribution, kept for min(1, p/q)."""
        if state.temperature > 0:
            q = logits_to_probs(z, state.temperature, state.top_k, state.top_p)  # [V]
            probs.append(q)
            return int(sample(q, state.generator))
        return int(z.argmax())

    @torch.no_grad()
    def verify_forward(self, state: DecodeState, tree: DraftTree) -> TargetOutput:
        """The completion pass: every row of this round through the rest of the layers; final logits."""
        target, cache = state.target, state.cache
        if tree.size != len(self._rows) or cache.length != self._past:
            raise RuntimeError("verify_forward must follow this drafter's own propose() of the same round")
        self._advance(target, cache, target.geometry.num_layers, newest_only=False)
        h = torch.stack([r.hidden for r in self._rows])[None]  # [1, N, d]
        return TargetOutput(logits=target.lm_head(h, norm=True), aux_hidden=None)
