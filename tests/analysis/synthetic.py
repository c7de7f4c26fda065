"""Builders of synthetic run records laid out as Hydra multirun sweeps (``<sweep>/<job>/record.json``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from analysis.results import TABLE_COLUMNS
from draftlab.data.benchmarks import category_column
from draftlab.eval.uncertainty import MIN_QUESTIONS, group_intervals, speedup_of, tau_of


def columns(tau0: float, sr0: float, *, skip: tuple[str, ...] = (), override: dict | None = None) -> dict:
    """Cells rising by 0.1 (τ) and 0.05 (SR) per column from WRIT's values; ``override`` pins cells."""
    out = {}
    for j, col in enumerate(TABLE_COLUMNS):
        if col in skip:
            continue
        out[col] = {"tau": round(tau0 + 0.1 * j, 4), "speedup": round(sr0 + 0.05 * j, 4), "n_questions": 10,
                    "method_tps": 100.0, "ar_tps": 50.0}
    for (col, key), value in (override or {}).items():
        out[col][key] = value
    return out


def make_record(*, label: str, nodes: int | None = 30, temperature: float = 0.0, ttt_length: int | None = None,
                cols: dict | None = None, accept_lengths: dict | None = None, history: list | None = None,
                kind: str = "eval", bench: str = "specbench", target: str = "smollm2_135m",
                run_name: str | None = None, max_new_tokens: int | None = None, draft_sha256: str | None = None,
                seed: int = 0) -> dict:
    """One run's record; ``max_new_tokens`` goes in ``eval`` (unset when None), ``draft_sha256`` names the
    evaluated draft's weights and ``seed`` the run config's seed (neither is a setting tables key rows by)."""
    method = {"EAGLE-3": "eagle3"}.get(label, "confu")
    ev = None
    if kind == "eval":
        axes = {k: v for k, v in (("nodes", nodes), ("ttt_length", ttt_length)) if v is not None}
        ev = {"bench": bench, "method": method, "label": label, "temperature": temperature, "axes": axes,
              "columns": cols or {}, "accept_lengths": accept_lengths or {},
              "mismatches_vs_ar": 0 if temperature == 0 else None}
        if max_new_tokens is not None:
            ev["max_new_tokens"] = max_new_tokens
    return {
        "schema": "draftlab.record/1", "kind": kind, "run_name": run_name or f"{method}-n{nodes}-t{temperature}",
        "group": "test", "tags": [], "choices": {"method": method, "target": target, "bench": bench},
        "overrides": [], "config": {"seed": seed}, "git": {"commit": "0" * 40, "dirty": False}, "hardware": {},
        "artifacts": {"draft": None, "data": None}, "metrics": {}, "eval": ev,
        "draft": {"path": None, "sha256": draft_sha256, "step": None},
        "train": {"history": history, "best": {}} if history else None,
    }


def write_sweep(root: Path, records: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, rec in enumerate(records):
        d = root / str(i)
        d.mkdir()
        (d / "record.json").write_text(json.dumps(rec, indent=1))
    return root


def question_rows(spreads: dict[str, tuple[float, float]], *, per_category: int = 10, seed: int = 0) -> list[dict]:
    """``eval.questions`` rows: ``per_category`` questions of each category, ``{category: (mean τ, spread)}``.

    A question's τ is drawn uniformly within ``mean ± spread`` and its speed-up follows it, so a category's
    spread sets how wide its intervals are. Question ids and categories depend on ``spreads`` and
    ``per_category`` only: records built with other seeds are repeats that answered the same questions.
    """
    rng = random.Random(seed)
    rows = []
    for category, (tau, spread) in spreads.items():
        for _ in range(per_category):
            rounds = rng.randint(20, 60)
            q_tau = tau + spread * rng.uniform(-1.0, 1.0)
            ar_tps = 40.0 + rng.uniform(-2.0, 2.0)
            rows.append({"question_id": len(rows), "category": category, "accepted": round(q_tau * rounds),
                         "rounds": rounds, "tps": round(ar_tps * q_tau * 0.6, 4), "ar_tps": round(ar_tps, 4)})
    return rows


def with_questions(record: dict, rows: list[dict], *, resamples: int = 400, seed: int = 0) -> dict:
    """``record`` with ``eval.questions = rows`` and the cells an evaluation computes from them: per column and
    AVG (all questions) τ, SR and their paired intervals (none below MIN_QUESTIONS questions), plus
    ``eval.interval``."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(category_column(row["category"]), []).append(row)
    groups["AVG"] = rows
    cols = {}
    for col, g in groups.items():
        cells = {"tau": tau_of(g), "speedup": speedup_of(g), "n_questions": len(g),
                 "method_tps": sum(r["tps"] for r in g) / len(g), "ar_tps": sum(r["ar_tps"] for r in g) / len(g)}
        few = len(g) < MIN_QUESTIONS
        cols[col] = cells | ({"tau_ci": None, "speedup_ci": None} if few
                             else group_intervals(g, resamples=resamples, seed=seed))
    record["eval"].update(columns=cols, questions=rows, interval={
        "method": "percentile bootstrap over questions", "resamples": resamples, "level": 0.95, "seed": seed,
        "min_questions": MIN_QUESTIONS})
    return record
