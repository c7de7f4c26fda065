"""How many tokens a round drafts: an entropy-based, cost-aware stopping rule, and fixed k for the ablation.

Drafting one more token pays only while its chance of being accepted exceeds its cost relative to the
round (SparseSpec-L's efficiency inversion): with acceptance p_i of the i-th draft, a round of m tokens
yields ``1 + sum_{j<=m} prod_{i<=j} p_i`` tokens on average (the bonus token included) and costs
``C_view + m C_d + C_v(m)``. The controller estimates ``p_i`` from the draft's entropy ``H_i`` by its distance
to the running mean entropies of accepted and of rejected drafts,
``p_i = e^{-|H_i - mu_acc|} / (e^{-|H_i - mu_acc|} + e^{-|H_i - mu_rej|})``, and, as an online stopping rule
(``p_{m+1}`` is unknown until token m+1 is drafted, so it is estimated by ``p_m``), stops after token m
when the estimated efficiency of m + 1 tokens is not higher than that of m. The costs are the drafter's own
measured times: compacting the view, one draft step, and a verify pass whose cost grows with its rows.
"""

from __future__ import annotations

import math


def _ema(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new


class FixedK:
    """Always ``k`` draft tokens (the ablation of the controller)."""

    def __init__(self, k: int):
        if int(k) < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)
        self.k_max = self.k

    def start_round(self) -> None:
        pass

    def keep_going(self, drafted: int, entropy: float) -> bool:
        return drafted < self.k

    def observe(self, entropies: list[float], accepted: int) -> None:
        pass

    def record_costs(self, *, view_s: float, step_s: float, verify_s: float, rows: int) -> None:
        pass


class EntropyController:
    """The online stopping rule above. ``k_init`` tokens a round until every cost has been measured once."""

    def __init__(self, k_init: int = 4, k_max: int = 16, decay: float = 0.9, mu_acc: float = 1.0,
                 mu_rej: float = 3.0, row_cost: float = 0.06):
        if not 1 <= int(k_init) <= int(k_max):
            raise ValueError(f"need 1 <= k_init <= k_max, got k_init={k_init}, k_max={k_max}")
        self.k_init, self.k_max, self.decay = int(k_init), int(k_max), float(decay)
        self.mu_acc, self.mu_rej = float(mu_acc), float(mu_rej)  # nats; cold start as the paper's defaults
        # A verify pass of r rows costs C_v1 (1 + row_cost (r - 1)): fitted to one measured pass per round.
        self.row_cost = float(row_cost)
        self.view_s: float | None = None
        self.step_s: float | None = None
        self.verify1_s: float | None = None
        self.start_round()

    def p_accept(self, entropy: float) -> float:
        a, r = math.exp(-abs(entropy - self.mu_acc)), math.exp(-abs(entropy - self.mu_rej))
        return a / (a + r)

    def start_round(self) -> None:
        self._prod = 1.0  # prod_{i<=m} p_i
        self._gain = 1.0  # 1 + sum_{j<=m} prod_{i<=j} p_i

    def _cost(self, m: int) -> float:
        return self.view_s + m * self.step_s + self.verify1_s * (1 + self.row_cost * m)

    def keep_going(self, drafted: int, entropy: float) -> bool:
        """After drafting token ``drafted`` (with draft entropy ``entropy``): draft another?"""
        p = self.p_accept(entropy)
        self._prod *= p
        self._gain += self._prod
        if drafted >= self.k_max:
            return False
        if self.verify1_s is None or self.step_s is None or self.view_s is None:
            return drafted < self.k_init
        now = self._gain / self._cost(drafted)
        nxt = (self._gain + self._prod * p) / self._cost(drafted + 1)
        return nxt > now

    def observe(self, entropies: list[float], accepted: int) -> None:
        """The round's outcome: the first ``accepted`` drafts were accepted, the next one (if any) rejected."""
        for h in entropies[:accepted]:
            self.mu_acc = _ema(self.mu_acc, h, self.decay)
        if accepted < len(entropies):
            self.mu_rej = _ema(self.mu_rej, entropies[accepted], self.decay)

    def record_costs(self, *, view_s: float, step_s: float, verify_s: float, rows: int) -> None:
        self.view_s = _ema(self.view_s, view_s, self.decay)
        self.step_s = _ema(self.step_s, step_s, self.decay)
        self.verify1_s = _ema(self.verify1_s, verify_s / (1 + self.row_cost * (rows - 1)), self.decay)
