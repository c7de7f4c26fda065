"""Saguaro's pieces (Kumar, Dao, May 2026, §4): the fan-out over verification outcomes, the bonus-token
candidates, and the sampling rule that makes bonus tokens predictable.

A verification outcome of a K-token chain is ``(j, t)``: j drafted tokens accepted, then the bonus token t.
The speculation cache holds a next chain for ``F_j`` likely bonus tokens at each j; ``F = [F_0 .. F_K]`` is
the fan-out.

- **Uniform**: ``F_j = F`` for every j.
- **Geometric** (Saguaro Thm 12): with a per-token acceptance ``a`` and a miss rate that falls as a power of the
  fan-out, ``1 - p_hit(F) = F^-r``, the budget ``B = sum_j F_j`` is best spent as ``F_j ∝ P(j)^(1/(1+r))``,
  ``P(j) = a^j (1 - a)`` for j < K and ``P(K) = a^K``: more candidates where verification is likelier to stop.
- **Candidates** at position j: the draft's top ``F_j`` tokens there, without the token the chain drafted at
  j (a rejected token has no residual mass, it cannot be the bonus).
- **σ_{F,C}**: at T > 0 a chain token at position j is drawn from q with the top ``F_j`` tokens' mass scaled
  by ``C ∈ (0, 1]`` and renormalised. A rejection's residual ``max(0, p - q')`` then sits mostly on exactly
  the cached candidates, so the bonus is predictable; the verifier is told q' (the law actually drawn
  from), which keeps the output exact.
"""

from __future__ import annotations

import math

import torch


def uniform_fanout(width: int, depth: int) -> list[int]:
    """``[width] * (depth + 1)``."""
    if int(width) < 0:
        raise ValueError(f"fan-out width must be >= 0, got {width}")
    return [int(width)] * (int(depth) + 1)


def stop_law(accept: float, depth: int) -> list[float]:
    """``P(j)``, j = 0..K: the chance that verification accepts exactly j of K tokens, each accepted with
    probability ``accept`` given the ones before."""
    a = float(accept)
    return [a ** j * (1 - a) for j in range(depth)] + [a ** depth]


def geometric_fanout(budget: int, depth: int, *, accept: float, r: float) -> list[int]:
    """Fan-outs ``F_j ∝ P(j)^(1/(1+r))`` summing to at most ``budget`` (largest remainders rounded up), each
    at least 1 while the budget allows."""
    if not 0.0 < float(accept) < 1.0 or float(r) <= 0:
        raise ValueError(f"geometric fan-out needs 0 < accept < 1 and r > 0, got {accept}, {r}")
    weights = [p ** (1.0 / (1.0 + float(r))) for p in stop_law(accept, depth)]
    total = sum(weights)
    exact = [int(budget) * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    for j in sorted(range(len(out)), key=lambda i: exact[i] - out[i], reverse=True)[: int(budget) - sum(out)]:
        out[j] += 1
    for j in range(len(out)):  # every outcome gets a candidate when the budget has any to move
        if out[j] == 0 and max(out) > 1:
            out[out.index(max(out))] -= 1
            out[j] = 1
    return out


def candidates(z: torch.Tensor, width: int, drafted: int | None) -> list[int]:
    """The top ``width`` tokens of logits ``z [V]``, leaving out ``drafted`` (the chain's token there)."""
    if width <= 0:
        return []
    top = torch.topk(z, min(width + 1, z.shape[-1])).indices.tolist()
    return [t for t in top if t != drafted][:width]


def saguaro_reshape(q: torch.Tensor, z: torch.Tensor, width: int, scale: float) -> torch.Tensor:
    """σ_{F,C}: ``q [..., V]`` with the mass of each row's top ``width`` tokens of ``z [..., V]`` scaled by
    ``scale``, renormalised. Which tokens are scaled depends on the logits only, never on a draw."""
    if scale >= 1.0 or width <= 0:
        return q
    top = torch.topk(z, min(width, z.shape[-1]), dim=-1).indices  # [..., width]
    out = q.scatter(-1, top, q.gather(-1, top) * float(scale))  # [..., V]
    mass = out.sum(-1, keepdim=True)  # [..., 1]
    if bool((mass > 0).all()):
        return out / mass
    return torch.where(mass > 0, out / mass.clamp_min(torch.finfo(out.dtype).tiny), q)  # a row with no mass stays q


class Reshaper:
    """The reshape a chain is drafted with (``DraftLM.chain(reshape=)``): position j uses ``fanout[j]``."""

    def __init__(self, fanout: list[int], scale: float):
        self.fanout, self.scale = list(fanout), float(scale)

    def __call__(self, position: int, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        width = self.fanout[position] if position < len(self.fanout) else 0
        return saguaro_reshape(q, z, width, self.scale)

    @property
    def active(self) -> bool:
        return self.scale < 1.0
