"""``draftlab-table --layout served`` for load runs: served throughput at several concurrency levels, with and
without the draft (``experiments/serving/concurrency.py``, measured by ``draftlab.eval.served_load``).

Where the numbers live: a run record (schema ``draftlab.record/1``, ``kind: eval``, so ``git``, ``hardware`` and
the provenance marks work as for every record) whose ``eval.concurrency`` block holds them; the experiment writes
it as ``experiments/serving/records/concurrency_<name>.json``::

    eval.concurrency = {"levels": [1, 4, 16], "repeats": R, "n_prompts": n, "max_tokens": m, "temperature": t,
                        "draft_name": str, "machine": {...},
                        "servers": {"plain" | "k<k>": {"num_speculative_tokens": k | null, "startups": [...],
                                                       "levels": {"<c>": {tps, tps_min, tps_max, tau, ...,
                                                                          "runs": [...]}}}},
                        "speedups": {"k<k>": [{"concurrency", "plain_tps", "draft_tps", "speedup",
                                               "interval": [lo, hi] | null, "interval_over": str | null,
                                               "tau", "plain_latency_p50_s", "draft_latency_p50_s",
                                               "repeats": {"plain", "draft"}}]}}

One row per (record, k, concurrency); nothing is pooled. The speed-up's bracket is the min / max of draft /
plain tok/s over every pair of repeats (``interval_over``; the two servers run one after the other, so the runs
are not paired): run-to-run spread, not a confidence interval; "–" with one run per level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from analysis.markdown import markdown_table
from analysis.results import Record
from analysis.table_model import PROVENANCE_MARKS, PROVENANCE_NOTES, provenance

HEADERS = ("Method", "Draft", "k", "Concurrency", "Prompts", "Runs", "plain tok/s", "draft tok/s",
           "speed-up [min, max]", "τ", "p50 latency plain s", "p50 latency draft s")
ALIGN = "lll" + "r" * (len(HEADERS) - 3)


def is_concurrency(record: Record) -> bool:
    """Whether ``record`` holds a served load run (an ``eval.concurrency`` block)."""
    return bool((record.eval or {}).get("concurrency"))


def _f(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _k_of(server: str) -> int:
    return int(server.removeprefix("k"))


def concurrency_rows(records: Sequence[Record], precision: int = 2) -> list[list[str]]:
    """The table's rows, records in the order given, then k, then concurrency (records without a load run
    are left out)."""
    p = f".{precision}f"
    rows = []
    for r in records:
        if not is_concurrency(r):
            continue
        block: dict[str, Any] = r.eval["concurrency"]
        mark = PROVENANCE_MARKS.get(provenance([r]), ("",))[0]
        for server in sorted(block.get("speedups") or {}, key=_k_of):
            for s in sorted(block["speedups"][server], key=lambda s: s["concurrency"]):
                lo_hi = s.get("interval")
                bracket = "" if lo_hi is None else f" [{lo_hi[0]:{p}}, {lo_hi[1]:{p}}]"
                runs = s.get("repeats") or {}
                rows.append([r.label + mark, str(block.get("draft_name") or "–"), str(_k_of(server)),
                             str(s["concurrency"]), str(block.get("n_prompts", "–")),
                             f"{runs.get('plain', '–')}/{runs.get('draft', '–')}",
                             _f(s["plain_tps"], ".1f"), _f(s["draft_tps"], ".1f"),
                             _f(s["speedup"], p) + ("" if s["speedup"] is None else bracket), _f(s["tau"], p),
                             _f(s["plain_latency_p50_s"], ".2f"), _f(s["draft_latency_p50_s"], ".2f")])
    return rows


def _notes(records: Sequence[Record]) -> list[str]:
    """What the brackets are over, what each record ran on, and the provenance marks shown."""
    runs = [r for r in records if is_concurrency(r)]
    notes = ["Speed-up = draft tok/s / plain tok/s (aggregate output tokens / wall time of the batch, mean over "
             "repeats); [min, max] over every (draft run, plain run) pair of repeats (separate server launches, "
             "not paired): run-to-run spread, not a confidence interval. Runs: repeats plain/draft. τ: the draft "
             "server's 1 + accepted / drafts over the level's batches."]
    for r in runs:
        m = r.eval["concurrency"].get("machine") or {}
        cpu = m.get("cpu_model") or (r.data.get("hardware") or {}).get("cpu") or "unknown CPU"
        notes.append(f"{r.run_name}: {cpu}, {m.get('cores', '?')} cores, max_tokens "
                     f"{r.eval['concurrency'].get('max_tokens')}, T={r.eval['concurrency'].get('temperature')}.")
    for state in sorted({provenance([r]) for r in runs} - {"clean"}):
        notes.append(f"{PROVENANCE_MARKS[state][0]} {PROVENANCE_NOTES[state]}.")
    return notes


def render_concurrency_markdown(records: Sequence[Record], precision: int = 2) -> str:
    """The table and its notes; ``ValueError`` when no record holds a load run."""
    rows = concurrency_rows(records, precision)
    if not rows:
        raise ValueError("no served load run (eval.concurrency) in these records: "
                         "see experiments/serving/concurrency.py")
    lines = markdown_table(HEADERS, rows, ALIGN)
    return "\n".join(lines + [""] + _notes(records)) + "\n"
