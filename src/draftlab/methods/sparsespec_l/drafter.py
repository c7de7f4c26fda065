"""SparseSpec-L drafting: the target drafts for itself over a sparse, recallable view of its own KV cache.

Per round:

1. ``propose``: select per layer and KV head the slots to read (``selection``: sinks, a recent window, the
   top slots by the attention mass the last verify passes put on them), gather them once into a small cache
   of their own (``SparseView.compact``; the target's dense cache is never changed), then run the target's
   full depth one token at a time over that small cache, at the tokens' true positions. The controller
   decides after each token whether to draft another.
2. The engine verifies the chain with a dense forward (the only thing that decides the output, so the
   result is exactly the target's) and asks it for the attention mass of its rows (``attention_rows``).
3. ``update``: the mass joins the history the next selection ranks by; the controller learns which draft
   entropies were accepted and what drafting and verifying cost.

At T = 0 a draft token is the sparse pass's argmax; at T > 0 it is sampled from the sparse pass's sampling
distribution, which travels with the tree as ``draft_probs`` so the verifier's min(1, p/q) rule stays exact.
"""

from __future__ import annotations

import time

import torch

from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.sparsespec_l.controller import EntropyController, FixedK
from draftlab.methods.sparsespec_l.selection import MassHistory, budget_slots, select_slots
from draftlab.targets.cache import KVCache, SparseView


def _entropy(probs: torch.Tensor) -> float:
    p = probs.float()
    return float(-(p * torch.log(p.clamp_min(1e-30))).sum())


class SparseSpecDrafter(Drafter):
    """Self-speculation over a sparse KV view (see the module docstring).

    budget, min_budget  slots per KV head a view keeps: ``max(min_budget, budget * context)``.
    sinks, window       the first ``sinks`` and the last ``window`` slots are always kept.
    stat_rows           W: slots are ranked by the attention mass of the last W verify query rows.
    refresh             reselect the slots every ``refresh`` rounds (1: after every verify pass).
    controller          ``entropy`` (the cost-aware stopping rule; ``k`` tokens until costs are measured)
                        or ``fixed`` (always ``k`` tokens).
    k_max               most tokens a round drafts.
    """

    def __init__(self, *, budget: float = 0.1, min_budget: int = 128, sinks: int = 4, window: int = 64,
                 stat_rows: int = 16, refresh: int = 1, controller: str = "entropy", k: int = 4, k_max: int = 16,
                 row_cost: float = 0.06):
        if not 0 < float(budget) <= 1:
            raise ValueError(f"budget is a fraction of the context in (0, 1], got {budget}")
        if int(stat_rows) < 1 or int(refresh) < 1:
            raise ValueError(f"stat_rows and refresh must be >= 1, got {stat_rows}, {refresh}")
        if controller not in ("entropy", "fixed"):
            raise ValueError(f"controller must be 'entropy' or 'fixed', got {controller!r}")
        if controller == "fixed" and int(k) > int(k_max):
            raise ValueError(f"fixed k={k} exceeds k_max={k_max}")
        self.budget, self.min_budget = float(budget), int(min_budget)
        self.sinks, self.window, self.stat_rows, self.refresh = int(sinks), int(window), int(stat_rows), int(refresh)
        self.controller_kind, self.k, self.k_max, self.row_cost = controller, int(k), int(k_max), float(row_cost)
        self._small: KVCache | None = None  # the compacted view, reused across rounds

    # ---- the contract ---------------------------------------------------------------------------------

    def attention_rows(self) -> int:
        return self.stat_rows

    def scratch_rows(self, cfg) -> int:
        return self.k_max + 1

    def reset(self, state: DecodeState) -> None:
        self.control = (FixedK(self.k) if self.controller_kind == "fixed" else
                        EntropyController(k_init=self.k, k_max=self.k_max, row_cost=self.row_cost))
        self.history = MassHistory(self.stat_rows)
        self.history.add(state.attn_mass, min(self.stat_rows, state.prompt_len))
        self._scores: torch.Tensor | None = None
        self._rounds = 0
        self._stats = {"drafted": 0, "accepted": 0, "read": 0.0, "keep": 0, "context": 0,
                       "view_s": 0.0, "step_s": 0.0, "verify_s": 0.0}

    def propose(self, state: DecodeState) -> DraftTree:
        t0 = time.perf_counter()
        target, cache = state.target, state.cache
        context = cache.length  # the root's slot: its K/V is not in the cache yet
        if self._scores is None or self._rounds % self.refresh == 0:
            self._scores = self.history.scores(context)
        keep = budget_slots(context, self.budget, self.min_budget)
        slots = select_slots(self._scores, context, keep, sinks=self.sinks, window=self.window)  # [L, Hkv, K]
        view = SparseView({li: slots[li] for li in range(slots.shape[0])})
        self._small = small = view.compact(cache, scratch_rows=self.k_max + 1, out=self._small)
        t1 = time.perf_counter()

        sampled = state.temperature > 0
        self.control.start_round()
        tokens, probs, self._entropies = [], [], []
        tok, step = state.root, torch.empty(1, 1, dtype=torch.long, device=target.device)
        while True:
            step.fill_(tok)
            pos = torch.tensor([context + len(tokens)], device=target.device)
            logits = target.forward(step, pos, small).logits[0, -1]  # [V]
            small.commit(1)
            if sampled:
                q = logits_to_probs(logits, state.temperature, state.top_k, state.top_p)  # [V]
                tok = int(sample(q, state.generator))
                probs.append(q)
            else:
                q = torch.softmax(logits.float(), -1)
                tok = int(logits.argmax())
            tokens.append(tok)
            self._entropies.append(_entropy(q))
            if not self.control.keep_going(len(tokens), self._entropies[-1]):
                break
        t2 = time.perf_counter()
        self._round = {"view_s": t1 - t0, "step_s": (t2 - t1) / len(tokens), "rows": len(tokens) + 1}
        s = self._stats
        s["drafted"] += len(tokens)  # one draft step per drafted token
        s["read"] += len(tokens) * keep / context
        s["keep"] += keep
        s["context"] += context
        s["view_s"] += t1 - t0
        s["step_s"] += t2 - t1
        self._t_proposed = time.perf_counter()
        return DraftTree.chain(state.root, tokens, draft_probs=torch.stack(probs) if sampled else None,
                               deterministic=not sampled)

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        verify_s = time.perf_counter() - self._t_proposed  # the engine's dense verify pass and commit
        accepted = len(out.result.path) - 1
        self.control.observe(self._entropies, accepted)
        r = self._round
        self.control.record_costs(view_s=r["view_s"], step_s=r["step_s"], verify_s=verify_s, rows=r["rows"])
        self.history.add(out.attn_mass, min(self.stat_rows, out.tree.size))
        self._rounds += 1
        self._stats["accepted"] += accepted
        self._stats["verify_s"] += verify_s

    def sequence_stats(self) -> dict[str, float] | None:
        s, n = self._stats, max(1, self._rounds)
        if not self._rounds:
            return None
        steps = max(1, s["drafted"])
        return {"k_mean": s["drafted"] / n, "draft_accept_rate": s["accepted"] / max(1, s["drafted"]),
                "kv_read_fraction": s["read"] / steps, "budget_mean": s["keep"] / n, "context_mean": s["context"] / n,
                "view_ms": 1e3 * s["view_s"] / n, "draft_step_ms": 1e3 * s["step_s"] / steps,
                "verify_ms": 1e3 * s["verify_s"] / n}
