"""Method-agnostic training metrics of draft models."""

from __future__ import annotations

from collections.abc import Sequence


def simulated_tau(acc: Sequence[float], *, include_bonus: bool = True) -> float:
    """Expected tokens per verify step of a greedy draft chain: ``1 + sum_k prod_{j<=k} acc_j``.

    SpecForge's ``simulated_acc_len`` is the sum without the 1. Here the bonus token the target emits
    every round is counted (``include_bonus=True``), so the value is on the same scale as Spec-Bench /
    EAGLE τ (new tokens per verify step) and as ``DecodeStats`` of the engine. The product is exact when
    ``acc`` are conditional accuracies (``cond_acc``); with EAGLE's unconditional ``acc`` it is
    SpecForge's approximation.
    """
    tau, run = 0.0, 1.0
    for a in acc:
        run *= float(a)
        tau += run
    return tau + (1.0 if include_bonus else 0.0)
