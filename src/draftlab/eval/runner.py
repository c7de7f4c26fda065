"""Benchmark runner: one method and AR on the same questions, in the same process.

For every question AR and the method answer back to back (so both see the same machine
state), each turn conditioned on that run's own earlier answers; the comparison drafters (``baselines``:
the training-free drafters a table sets beside a learned draft) answer right after them and are scored
against the same AR answers. Answers go to Spec-Bench answer files
(``<out>/answers/ar.jsonl``, ``<out>/answers/<method>.jsonl``, one per baseline); τ and SR are computed from those
files exactly as Spec-Bench's ``speed.py`` does (``draftlab.eval.metrics``), over wall time or, with
``timing="decode"``, over the time after each prefill.

Tables and flat metrics show the ConFu columns, then every category that has no column (long-context
and custom benchmarks: their numbers are still reported, just not folded into a column), then AVG.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from draftlab.data.benchmarks import Question, category_column
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.eval.answers import answer_record, load_answers, write_answer
from draftlab.eval.metrics import TIMINGS, Timing, accept_histogram, mismatched_questions, speed_metrics
from draftlab.eval.turns import answer_question
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

AR_NAME = "ar"  # autoregressive decoding's name: its answer file (answers/ar.jsonl), model_id and scores entry


@dataclass
class EvalResult:
    bench: str
    method: str
    gen: GenerationConfig
    metrics: dict[str, Any]  # speed_metrics(): columns / categories / AVG
    accept_histogram: dict[int, int]
    mismatches_vs_ar: int | None  # questions whose output differs from AR (T=0 only; must be 0)
    mismatched_ids: list = field(default_factory=list)
    answer_files: dict[str, str] = field(default_factory=dict)
    baselines: dict[str, EvalResult] = field(default_factory=dict)  # name -> the same scores of each comparison drafter
    timing: Timing = "wall"  # what throughputs divide by: wall time, or decode time (wall less prefill)

    def flat_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``eval/<bench>/<COLUMN>/{tau,speedup}`` and their interval bounds (``tau_ci_lo`` ...), plus categories
        without a column, AVG and the mismatch count: W&B-style keys."""
        out: dict[str, float] = {}
        for col, m in report_groups(self.metrics).items():
            for key in ("tau", "speedup", "method_tps", "ar_tps"):
                if m.get(key) is not None:
                    out[f"{prefix}/{self.bench}/{col}/{key}"] = float(m[key])
            for key in ("tau_ci", "speedup_ci"):  # the bootstrap interval's bounds, e.g. .../AVG/tau_ci_lo
                if m.get(key):
                    out[f"{prefix}/{self.bench}/{col}/{key}_lo"] = float(m[key][0])
                    out[f"{prefix}/{self.bench}/{col}/{key}_hi"] = float(m[key][1])
        if self.mismatches_vs_ar is not None:
            out[f"{prefix}/{self.bench}/mismatches_vs_ar"] = float(self.mismatches_vs_ar)
        return out


def _limit_turns(q: Question, max_turns: int | None) -> Question:
    if max_turns is None or len(q.turns) <= max_turns:
        return q
    return Question(q.question_id, q.category, list(q.turns[:max_turns]), q.reference)


def run_benchmark(target, questions: list[Question], drafter, gen: GenerationConfig, out_dir: str | Path, *,
                  bench: str, method: str, warmup: int = 1, max_turns: int | None = None,
                  baselines: Mapping[str, Any] | None = None, timing: Timing = "wall") -> EvalResult:
    """Answer ``questions`` with AR, ``drafter`` and each of ``baselines`` (name -> (drafter, each
    with its own GenerationConfig scratch rows)); write answers; score each against the AR answers, with
    throughputs over wall time or decode time (``timing``)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'wall' or 'decode', got {timing!r}")
    out = Path(out_dir) / "answers"
    out.mkdir(parents=True, exist_ok=True)
    baselines = dict(baselines or {})
    clash = {AR_NAME, method} & set(baselines)
    if clash:
        raise ValueError(f"eval baselines may not be named {sorted(clash)}: the answer files would collide")
    ar_path, method_path = out / f"{AR_NAME}.jsonl", out / f"{method}.jsonl"
    other_paths = {name: out / f"{name}.jsonl" for name in baselines}
    # Answers go to ``<file>.partial`` and take their final name only once every question is answered
    # and the file reads back valid: a killed run leaves no answer file that looks finished. A re-run
    # starts over rather than resuming, so that every speed-up pairs two runs of one process.
    partial = {final: final.with_name(final.name + ".partial")
               for final in (ar_path, method_path, *other_paths.values())}
    for p in (*partial, *partial.values()):
        p.unlink(missing_ok=True)
    questions = [_limit_turns(q, max_turns) for q in questions]
    if warmup and questions:
        # First calls pay for allocator growth and lazy init; keep them out of the timings.
        prompt = target.tokenizer.encode("Hello")
        warm = GenerationConfig(max_new_tokens=16, temperature=0.0)
        for _ in range(warmup):
            speculative_generate(target, prompt, None, warm)
            speculative_generate(target, prompt, drafter, warm)
            for other in baselines.values():
                speculative_generate(target, prompt, other[0], warm)
    desc = " + ".join([method, *baselines])
    for q in tqdm(questions, desc=f"{bench} / {desc}", unit="question"):
        ar = answer_question(target, q, drafter=None, cfg=gen)
        write_answer(partial[ar_path], answer_record(q, ar, AR_NAME))
        spec = answer_question(target, q, drafter=drafter, cfg=gen)
        write_answer(partial[method_path], answer_record(q, spec, method))
        for name, (other, other_gen) in baselines.items():
            write_answer(partial[other_paths[name]],
                         answer_record(q, answer_question(target, q, drafter=other, cfg=other_gen), name))
    for final, tmp in partial.items():
        load_answers(tmp)
        os.replace(tmp, final)
    ar_answers = load_answers(ar_path)
    result = _score(bench, method, gen, load_answers(method_path), ar_answers, ar_path, method_path, timing)
    result.baselines = {name: _score(bench, name, baselines[name][1], load_answers(path), ar_answers, ar_path, path,
                                     timing)
                        for name, path in other_paths.items()}
    return result


def _score(bench: str, method: str, gen: GenerationConfig, method_answers, ar_answers, ar_path: Path,
           method_path: Path, timing: Timing) -> EvalResult:
    metrics = speed_metrics(method_answers, ar_answers, column_of=_column_or_none, timing=timing)
    mismatched = mismatched_questions(method_answers, ar_answers) if gen.temperature == 0 else []
    if mismatched:
        log.error("%s: %d question(s) differ from AR at T=0: %s", method, len(mismatched), mismatched[:10])
    return EvalResult(bench=bench, method=method, gen=gen, metrics=metrics,
                      accept_histogram=accept_histogram(method_answers),
                      mismatches_vs_ar=len(mismatched) if gen.temperature == 0 else None,
                      mismatched_ids=list(mismatched),
                      answer_files={AR_NAME: str(ar_path), method: str(method_path)}, timing=timing)


def _column_or_none(category: str) -> str | None:
    # Benchmarks outside Spec-Bench (HumanEval "coding" maps; custom ones may not) still get an AVG.
    try:
        return category_column(category)
    except Exception:  # noqa: BLE001 - DataError for unknown categories
        return None


def report_groups(metrics: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The rows a table reports: the ConFu columns, then each category without a column, then ``AVG``.

    A long-context category (``gov_report_summ``, ``niah_16k``) has no ConFu column; listing it by name
    keeps its τ and SR visible instead of only inside AVG. Column names are upper case and categories
    lower case, so the two never collide.
    """
    groups = dict(metrics["columns"])
    for category, m in metrics["categories"].items():
        if _column_or_none(category) is None:
            groups[category] = m
    groups["AVG"] = metrics["AVG"]
    return groups


def format_table(result: EvalResult) -> str:
    """A fixed-width per-column table: τ and SR with their bootstrap intervals over the questions (SR paired
    with AR), tok/s of the method and of AR, question count."""
    pct = f"{100 * (result.metrics.get('interval') or {}).get('level', 0.95):g}%"
    rows = [("column", "n", "tau", f"tau {pct} CI", "SR", f"SR {pct} CI", "tok/s", "AR tok/s")]
    for col, m in report_groups(result.metrics).items():
        rows.append((col, str(m.get("n_questions", "")), f"{m['tau']:.2f}", _interval(m.get("tau_ci")),
                     f"{m['speedup']:.2f}", _interval(m.get("speedup_ci")), f"{m['method_tps']:.1f}",
                     f"{m['ar_tps']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    head = (f"{result.bench} | {result.method} | T={result.gen.temperature} | max_new_tokens={result.gen.max_new_tokens}"
            f" | timing={result.timing}")
    tail = "" if result.mismatches_vs_ar is None else f"\noutputs differing from AR: {result.mismatches_vs_ar}"
    return head + "\n" + "\n".join(lines) + tail


def _interval(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-"


def format_comparison(result: EvalResult, labels: Mapping[str, str] | None = None) -> str:
    """The method beside every comparison drafter of the run: SR per column and AVG τ / SR, one row each, and
    which training-free drafter did best on the average."""
    labels = dict(labels or {})
    runs = [result, *result.baselines.values()]
    cols = [c for c in report_groups(result.metrics) if c != "AVG"]
    rows = [("", *cols, "AVG tau", "AVG SR")]
    names = [labels.get(r.method, r.method) for r in runs]
    # One method at several settings (tree sizes as baselines) shares a label: name each row's setting too.
    names = [f"{n} [{r.method}]" if names.count(n) > 1 else n for n, r in zip(names, runs)]
    for r, name in zip(runs, names):
        cells = report_groups(r.metrics)
        rows.append((name, *(f"{cells[c]['speedup']:.2f}" for c in cols),
                     f"{r.metrics['AVG']['tau']:.2f}", f"{r.metrics['AVG']['speedup']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    text = f"SR per column vs AR, same questions and process ({result.bench}, T={result.gen.temperature})\n"
    text += "\n".join(lines)
    if result.baselines:
        best = max(result.baselines.values(), key=lambda r: r.metrics["AVG"]["speedup"])
        mine, theirs = result.metrics["AVG"]["speedup"], best.metrics["AVG"]["speedup"]
        text += (f"\n{labels.get(result.method, result.method)}: SR {mine:.2f}; best baseline "
                 f"{labels.get(best.method, best.method)}: SR {theirs:.2f} ({mine / theirs:.2f}x of it)")
    return text
