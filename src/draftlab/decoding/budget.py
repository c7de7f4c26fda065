"""Cost-aware tree sizing (``tree: auto``): each round's tree as big as pays for itself on this machine.

A fixed node count is right for one draft, one prompt and one machine. The drafter already scores every
candidate (EAGLE-2's cumulative draft probability approximates the chance that the target accepts its
whole path) and the verify pass has a price per row (``decoding.cost``), so each round can pick the size
that maximises expected tokens per second:

    E(n) = 1 + a * sum_{i <= n} p_i          tokens a round yields (bonus token included) with the n best nodes
    C(n) = (levels + 1) * t_level + V(rows(n), L)  seconds: the draft levels run, the draft's accept pass, one
                                                  verify over the L tokens decoded so far
    n*   = argmax_n E(n) / C(n),  0 <= n <= nodes  (the configured size becomes a cap)

``p_i`` are the candidates' path probabilities in best-first order (a prefix of that order is always an
ancestor-closed tree), ``a`` a calibration factor learned online: the ratio of accepted draft tokens to
the ``sum p_i`` predicted for the trees actually verified (exponential moving averages of both, starting
at a = 1; rounds that verify no node move it back towards 1, so a draft judged useless is tried again
later). ``t_level`` is the measured wall time of one draft level. Growth also stops early: another
level can add at most ``a * sum(p_frontier)`` expected tokens (a node's children share its probability)
for at least one more ``t_level``; once that bound cannot beat the best ratio so far, the round's
remaining draft passes are skipped. ``V`` depends on the context length ``L`` (``decoding.cost``): the
drafter sets ``budget.context`` each round, so a long prompt is planned with its own, dearer step.

A composite drafter (``methods.hybrid``) verifies another proposal in the same pass: ``alongside(tokens,
rows)`` tells the budget, for the coming round, the tokens that proposal is expected to bring and the
rows it adds. They enter ``E`` and ``V`` of every size, so a confident companion leaves fewer nodes worth
their rows (the marginal node must beat a higher average rate).

Sizing only chooses which proposals get verified; the verifier and its acceptance rule are untouched. That
keeps greedy outputs equal to AR, and keeps sampling exact under the rule of ``decoding.drafter``: for
deterministic candidates (top-k trees, lookups) any choice made without the verifier's coins is exact;
for sampled proposals the scores handed to ``choose`` must be functions of the draft distributions only,
never of the tokens drawn from them (``methods.dflash.drafter`` says why and how).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from draftlab.decoding.cost import ContextVerifyCost, VerifyCost

_RECOVER = 0.02  # per empty round, the share of the way the calibration moves back towards 1


class TreeBudget:
    """Chooses each round's tree size and learns from what verification accepted.

    - ``cost``: seconds of a verify pass per row count; None = measured from the target at first use.
    - ``rows_per_node``: verify rows each node (the root included) brings: 1, or 2 for a method that adds a
      row per node (ConFu's contemplate rows); ``extra_rows``: rows every pass has besides.
    - ``level_seconds``: a fixed draft-level time (tests); None = measured from the drafter's own passes.
    - ``decay``: the moving averages' weight on the past (0.9: about the last ten rounds).
    """

    def __init__(self, cost: VerifyCost | ContextVerifyCost | None = None, *, rows_per_node: int = 1, extra_rows: int = 0,
                 level_seconds: float | None = None, decay: float = 0.9):
        self.cost, self.rows_per_node, self.extra_rows = cost, rows_per_node, extra_rows
        self.fixed_level = level_seconds
        self.decay = decay
        self._level_s: float | None = level_seconds
        self._accepted, self._predicted = 1.0, 1.0  # moving sums (a prior of a = 1)
        self.predicted_last: float | None = None  # sum p_i of the last chosen tree
        self.sizes: list[int] = []  # chosen node counts, per round (for reports)
        self.context: int | None = None  # tokens in the sequence this round verifies after (set by the drafter)
        self._companion = (0.0, 0)  # (expected tokens, rows) another proposal brings to this round's pass

    def alongside(self, tokens: float, rows: int) -> None:
        """Another proposal, verified in the same pass as the coming round's tree, is expected to yield
        ``tokens`` accepted tokens and adds ``rows`` verify rows (cleared when the round is sized)."""
        self._companion = (max(float(tokens), 0.0), max(int(rows), 0))

    # -- inputs ------------------------------------------------------------------------------------

    def bind(self, target) -> None:
        """Measure the verify cost curve of ``target`` unless one was given (once per target object)."""
        if self.cost is None:
            from draftlab.decoding.cost import verify_cost

            self.cost = verify_cost(target)

    @property
    def calibration(self) -> float:
        return self._accepted / self._predicted

    @property
    def level_seconds(self) -> float:
        return self._level_s if self._level_s is not None else 0.0

    def timed(self, expand: Callable) -> Callable:
        """``expand`` with its wall time folded into the draft-level estimate (unless it is fixed)."""
        if self.fixed_level is not None:
            return expand

        def run(batch):
            t0 = time.perf_counter()
            out = expand(batch)
            dt = time.perf_counter() - t0
            self._level_s = dt if self._level_s is None else self.decay * self._level_s + (1 - self.decay) * dt
            return out
        return run

    def observe(self, accepted_nodes: int) -> None:
        """After verification: ``accepted_nodes`` draft tokens of the last chosen tree were accepted. Once per
        chosen tree: later calls for the same round are ignored (a composite drafter may account first)."""
        if self.predicted_last is None:
            return
        d = self.decay
        self._accepted = d * self._accepted + (1 - d) * accepted_nodes
        self._predicted = d * self._predicted + (1 - d) * max(self.predicted_last, 1e-6)
        self.predicted_last = None

    # -- decisions ---------------------------------------------------------------------------------

    def _seconds(self, nodes: torch.Tensor, levels: int) -> torch.Tensor:
        # root + nodes (each with its own extra rows), the method's extra rows and a companion proposal's
        rows = self.rows_per_node * (nodes + 1) + self.extra_rows + self._companion[1]
        verify = torch.tensor([self.cost(int(r), self.context) for r in rows.tolist()], dtype=torch.float64)
        return (levels + 1) * self.level_seconds + verify

    def _rates(self, probs: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expected tokens, seconds and tokens/second for n = 0..len(probs) best nodes."""
        a = self.calibration
        gain = torch.cat([torch.zeros(1, dtype=torch.float64), (a * probs.double()).clamp(max=1.0).cumsum(0)])
        tokens = 1.0 + self._companion[0] + gain  # [n+1]
        seconds = self._seconds(torch.arange(probs.shape[0] + 1), levels)
        return tokens, seconds, tokens / seconds

    def choose(self, probs: torch.Tensor, levels: int) -> int:
        """Nodes to keep, from the best-first path probabilities ``probs [N]`` of the candidates (N = cap)."""
        if self.cost is None:
            raise RuntimeError("TreeBudget has no verify cost: call bind(target) first")
        _, _, rate = self._rates(probs, levels)
        self._companion = (0.0, 0)  # one round's
        n = int(torch.argmax(rate))  # first maximum: the smaller tree on ties
        if n == 0:
            # Nothing verified, nothing learnt: without this, a calibration that once fell low enough to pick
            # empty trees would stay there. Drift back towards the prior (a = 1) instead, ~50 rounds to it.
            self._accepted += _RECOVER * (1.0 - self._accepted)
            self._predicted += _RECOVER * (1.0 - self._predicted)
        self.predicted_last = float(probs[:n].double().sum()) if n else None
        self.sizes.append(n)
        return n

    def keep_growing(self, probs: torch.Tensor, frontier_probs: torch.Tensor, levels: int) -> bool:
        """Whether another draft level can still raise the best rate (an optimistic bound: the next level's
        children add at most ``a * sum(frontier_probs)`` tokens, and cost at least one more level)."""
        if self.cost is None or frontier_probs.numel() == 0:
            return frontier_probs.numel() > 0
        tokens, seconds, rate = self._rates(probs, levels)
        best = int(torch.argmax(rate))
        bound = (tokens[best] + self.calibration * float(frontier_probs.double().sum())) / (seconds[best] + self.level_seconds)
        return bool(bound > rate[best])


def tree_budget(tree: str, **kwargs) -> TreeBudget | None:
    """A drafter's ``tree`` setting: ``fixed`` (None: the configured size every round) or ``auto``."""
    if tree == "fixed":
        return None
    if tree == "auto":
        return TreeBudget(**kwargs)
    raise ValueError(f"tree must be 'fixed' or 'auto', got {tree!r}")
