"""The overfit gate (``experiment=gate``): a draft trained to memorise one conversation, exported, served, and
asked that conversation's first turn must accept nearly every drafted token in the engine.

A recipe can fail silently between training and serving (a weight name the engine skips, a norm or a layer id
read differently, a vocabulary map applied twice): the engine still decodes losslessly, only slower. The gate
removes the draft's quality from the question: a draft that reproduces its one training answer in draftlab
must do so in the engine too. It passes when, for every chain length served, the share of drafted tokens the
engine accepted is at least ``min_acceptance`` and the engine's output with the draft equals its plain output.
The draftlab side (its chain on the same prompt) and the parity interval are printed beside it, so a failure
says which side lost the acceptances.
"""

from __future__ import annotations

from typing import Any

from draftlab.utils.errors import UserError


class GateFailed(UserError):
    """The served draft did not accept what it was trained to (the record is written first)."""


def gate_verdict(served: list[dict[str, Any]], *, min_acceptance: float) -> dict[str, Any]:
    """``served``: the served evaluation's per-chain records (``draftlab.eval.served_metrics.compare``)."""
    if not served:
        raise ValueError("the gate needs a served evaluation (eval.engine=vllm|sglang)")
    chains = []
    for rec in served:
        counters = rec["served"]["counters"]
        mine = rec["draftlab"]["counters"]
        rate = counters["accepted"] / counters["draft_tokens"] if counters["draft_tokens"] else 0.0
        own = mine["accepted"] / mine["draft_tokens"] if mine["draft_tokens"] else 0.0
        lossless = rec["identical_to_plain"] == rec["n_prompts"]
        chains.append({"k": rec["num_speculative_tokens"], "served_acceptance": rate, "draftlab_acceptance": own,
                       "served_tau": rec["served"]["tau"], "draftlab_tau": rec["draftlab"]["tau"],
                       "position_rates": rec["served"]["position_rates"], "lossless": lossless,
                       "passed": rate >= min_acceptance and lossless})
    return {"min_acceptance": min_acceptance, "passed": all(c["passed"] for c in chains), "chains": chains}


def format_gate(gate: dict[str, Any], engine: str) -> str:
    lines = [f"Overfit gate ({engine}): served acceptance >= {gate['min_acceptance']:.2f} of drafted tokens, "
             f"outputs identical to {engine} plain"]
    for c in gate["chains"]:
        rates = " ".join(f"{r:.2f}" for r in c["position_rates"])
        lines.append(f"  k={c['k']}: {engine} accepted {c['served_acceptance']:.3f} (tau {c['served_tau']:.2f}, "
                     f"per position {rates}); draftlab {c['draftlab_acceptance']:.3f} (tau {c['draftlab_tau']:.2f}); "
                     f"lossless {'yes' if c['lossless'] else 'NO'} -> {'PASS' if c['passed'] else 'FAIL'}")
    lines.append(f"GATE {'PASSED' if gate['passed'] else 'FAILED'}")
    return "\n".join(lines)


def apply_gate(cfg, record: dict[str, Any], metrics: dict[str, float]) -> None:
    """With ``eval.gate.min_acceptance`` set: the verdict into the record and the metrics, printed."""
    block = cfg.eval.get("gate")
    if not block:
        return
    gate = gate_verdict(record.get("served") or [], min_acceptance=float(block.get("min_acceptance", 0.8)))
    record["gate"] = gate
    metrics["eval/gate/passed"] = float(gate["passed"])
    print(format_gate(gate, record.get("engine", "engine")))


def raise_if_failed(eval_record: dict[str, Any] | None) -> None:
    """After the record is written: a failed gate ends the job with an error."""
    gate = (eval_record or {}).get("gate")
    if gate is not None and not gate["passed"]:
        worst = min(gate["chains"], key=lambda c: c["served_acceptance"])
        raise GateFailed(f"overfit gate failed: served acceptance {worst['served_acceptance']:.3f} at k={worst['k']} "
                         f"< {gate['min_acceptance']:.2f}" + ("" if worst["lossless"] else "; outputs differ from plain"))
