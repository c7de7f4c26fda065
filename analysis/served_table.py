"""``draftlab-table --layout served``: served τ beside draftlab's τ, one row per run and chain length.

Reads the ``eval.served`` list a served evaluation records (``eval.engine=vllm|sglang``): per chain length k,
τ of the engine's own counters and of draftlab's chain on the same prompts, the paired-bootstrap interval of
their gap, outputs identical to the engine's plain decoding, and the two speed-ups measured side by side
(served draft over served plain; draftlab chain over draftlab AR). Nothing is pooled: each row is one run's
one chain. The last column is the same chain sampled at T = 1 (a run with ``eval.temperature=1``: its
``served_sampled`` entry): served τ / draftlab τ and the verdict of the comparison of the two acceptance
distributions ("–" where the run sampled no chain at T = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from analysis.results import Record

HEADERS = ("Method", "Setting", "Engine", "Prompts", "k", "served τ", "draftlab τ", "gap [95% CI]",
           "= plain", "= draftlab", "served SR", "draftlab SR", "T=1 τ served / draftlab")


def _served(r: Record) -> list[dict[str, Any]]:
    served = (r.eval or {}).get("served")
    if isinstance(served, dict):  # one chain, recorded before lists
        served = [served]
    return list(served or [])


def _f(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _sampled_t1(r: Record, k: int, spec: str) -> str:
    """Served τ / draftlab τ and the verdict of the chain of k sampled at T = 1, "–" without one."""
    for e in (r.eval or {}).get("served_sampled") or []:
        if e.get("temperature") == 1.0 and e.get("num_speculative_tokens") == k:
            return f"{_f(e['served']['tau'], spec)} / {_f(e['draftlab']['tau'], spec)} {e.get('verdict') or 'not judged'}"
    return "–"


def _flag(par: dict[str, Any]) -> str:
    """GAP: beyond noise; "end": beyond noise but all of it acceptances the engine counted past max_tokens."""
    return ("" if not par["flagged"] else
            f" end (+{par['last_round_excess']['tokens']} past max_tokens)" if par.get("last_round_excess") else " GAP")


def served_rows(records: Sequence[Record], precision: int = 2) -> list[list[str]]:
    """The table's rows (records without a served evaluation are left out)."""
    from analysis.table_keys import setting_text

    p = f".{precision}f"
    rows = []
    for r in records:
        for s in sorted(_served(r), key=lambda s: s["num_speculative_tokens"]):
            par, speed, n = s["parity"], s.get("speed") or {}, s["n_prompts"]
            ci = "–" if par.get("ci") is None else (f"{par['gap']:+.{precision}f} [{par['ci'][0]:+.{precision}f}, "
                                                    f"{par['ci'][1]:+.{precision}f}]" + _flag(par))
            rows.append([r.label, setting_text(r), str(s.get("engine", "")), str(n), str(s["num_speculative_tokens"]),
                         _f(s["served"]["tau"], p), _f(s["draftlab"]["tau"], p), ci, f"{s['identical_to_plain']}/{n}",
                         f"{s['same_tokens_as_draftlab']}/{n}", _f(speed.get("served_speedup"), p),
                         _f(speed.get("draftlab_speedup"), p), _sampled_t1(r, s["num_speculative_tokens"], p)])
    return rows


def render_served_markdown(records: Sequence[Record], precision: int = 2) -> str:
    rows = served_rows(records, precision)
    if not rows:
        raise ValueError("no served evaluation in these records (run with eval.engine=vllm or sglang)")
    align = ["---" if i < 3 else "---:" for i in range(len(HEADERS))]
    lines = ["| " + " | ".join(HEADERS) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
