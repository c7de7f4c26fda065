"""The evaluation stage: a drafter against AR on a benchmark, in one process, into an eval record.

The record stores the resolved method config (drafter included) and the method's declared ``axes``
(``conf/method/<m>.yaml``), so tables compare runs by the settings each method actually has: an axis on a
training setting (a draft's block size, its TTT length) is read from the evaluated artifact's training
config, since a draft evaluated under another config keeps what it was trained with.

``eval.baselines`` (name -> a method config, composed from ``conf/method`` by the defaults list, e.g.
``- /method@eval.baselines.<name>: <method>``) adds drafters that answer the same questions in the same
process and are scored against the same AR answers: what a learned draft buys over them is then printed
side by side (``eval_comparison.txt``) and kept in the record (``eval.baselines``). A training-free baseline
builds its own drafter; a trainable one drafts from this run's draft, so it must read the main method's
artifact format (the same ``artifact`` block), e.g. a learned draft with lookup candidates merged in.

Every bench is loaded with the target's tokenizer (a long-context bench fits its prompts to the budget
with it; the rest ignore it). A bench with ``scored(category)`` (``LongContextBench``: NIAH) has the answers
of those categories scored by whether the reference appears in them, for AR, the method and each
baseline (``record["scores"]``, ``eval/<bench>/found/<name>``). ``eval.timing`` picks wall-clock or
decode-only throughputs (wall time less prefill time: a long prompt's prefill would swamp the decoding).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from draftlab import tracking
from draftlab.decoding.drafter import closing_all
from draftlab.decoding.engine import GenerationConfig, scratch_for
from draftlab.eval.metrics import TIMINGS
from draftlab.eval.runner import AR_NAME
from draftlab.eval.scoring import bench_scores, format_scores
from draftlab.methods.artifact import DraftArtifact
from draftlab.methods.registry import MethodSpec
from draftlab.utils.atomic import atomic_write_text
from draftlab.utils.errors import ConfigError


def generation_config(cfg: DictConfig, drafter=None) -> GenerationConfig:
    """The engine settings of ``cfg.eval``, with scratch room for the drafter's largest verify pass."""
    e = cfg.eval
    gen = GenerationConfig(max_new_tokens=int(e.max_new_tokens), temperature=float(e.temperature),
                           top_k=e.get("top_k"), top_p=e.get("top_p"), seed=int(cfg.seed),
                           scratch_rows=int(e.get("scratch_rows", 128)))
    gen.scratch_rows = scratch_for(gen, drafter)  # what the engine reserves for this drafter, recorded
    return gen


def evaluate(cfg: DictConfig, target, drafter, run_dir: Path, spec: MethodSpec, loggers: list | None = None,
             artifact: DraftArtifact | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Run ``cfg.bench`` with ``drafter`` and AR; returns (eval record, flat metrics).
    ``artifact``: the run's trained draft, read once by the pipeline (None for a training-free method): its
    draft for trainable baselines, its training config for the axes on training settings; ``spec``: the run's
    method (``MethodSpec(cfg.method)``, built once by the pipeline).

    The stage owns ``drafter`` and the baselines' drafters it builds: all are closed (``Drafter.close``) when
    it returns, also when decoding raises."""
    from draftlab.eval.served import check_engine, served_evaluate

    with closing_all(drafter):
        if check_engine(cfg) != "draftlab":  # a serving engine: the run's draft exported, served, compared
            from draftlab.eval.gate import apply_gate

            record, metrics = served_evaluate(cfg, target, artifact, run_dir, spec)
            apply_gate(cfg, record, metrics)  # eval.gate (experiment=gate): the overfit verdict
            return record, metrics
        with ExitStack() as stack:
            baselines, bspecs = baseline_drafters(cfg, spec, artifact.draft if artifact else None, stack)
            trained = artifact.trained_config if artifact is not None else None
            return _evaluate_here(cfg, target, drafter, run_dir, loggers, trained, baselines, bspecs, spec)


def _evaluate_here(cfg: DictConfig, target, drafter, run_dir: Path, loggers: list | None, trained: dict | None,
                   baselines: dict[str, tuple[Any, GenerationConfig]], bspecs: dict[str, MethodSpec], spec: MethodSpec
                   ) -> tuple[dict[str, Any], dict[str, float]]:
    # ``evaluate`` with draftlab's own engine, the baselines built.
    from draftlab.eval.runner import format_comparison, format_table, run_benchmark

    timing = eval_timing(cfg)
    bench = instantiate(cfg.bench, _convert_="object")
    questions = bench.load(tokenizer=target.tokenizer)
    gen = generation_config(cfg, drafter)
    if AR_NAME in baselines:
        raise ConfigError(f"the name '{AR_NAME}' is autoregressive decoding's (its answers and scores); rename this "
                          "baseline", field=f"eval.baselines.{AR_NAME}")
    labels = {n: b.label for n, b in bspecs.items()}
    labels[spec.name] = spec.label
    res = run_benchmark(target, questions, drafter, gen, run_dir, bench=bench.name, method=spec.name,
                        warmup=int(cfg.eval.warmup), max_turns=cfg.eval.get("max_turns"), baselines=baselines,
                        timing=timing)
    table = format_table(res)
    print(table)
    atomic_write_text(run_dir / "eval_table.txt", table + "\n")
    metrics = res.flat_metrics()
    compared = {}
    if res.baselines:
        comparison = format_comparison(res, labels)
        print(comparison)
        atomic_write_text(run_dir / "eval_comparison.txt", comparison + "\n")
        for name, r in res.baselines.items():
            metrics.update(r.flat_metrics(prefix=f"baselines/{name}"))
            compared[name] = {"method": r.method, "label": labels[name], "axes": bspecs[name].axes(trained if bspecs[name].trainable else None),
                               "columns": dict(r.metrics["columns"]) | {"AVG": r.metrics["AVG"]},
                               "categories": r.metrics["categories"],
                               "accept_lengths": {str(k): v for k, v in r.accept_histogram.items()},
                               "mismatches_vs_ar": r.mismatches_vs_ar, "answer_files": r.answer_files,
                               "questions": r.metrics.get("questions"), "interval": r.metrics.get("interval")}
    record = {"bench": bench.name, "method": spec.name, "label": spec.label, "temperature": gen.temperature,
              "axes": spec.axes(trained), "method_config": {k: v for k, v in spec.resolved().items() if k != "axes"},
              "max_new_tokens": gen.max_new_tokens,
              "columns": dict(res.metrics["columns"]) | {"AVG": res.metrics["AVG"]},
              "categories": res.metrics["categories"],
              "accept_lengths": {str(k): v for k, v in res.accept_histogram.items()},
              "mismatches_vs_ar": res.mismatches_vs_ar, "answer_files": res.answer_files,
              # per question: accepted tokens, rounds, method and AR tok/s (intervals, paired comparisons)
              "questions": res.metrics.get("questions"), "interval": res.metrics.get("interval"),
              "baselines": compared, "timing": timing,
              # compiled passes (engine.compile): graphs, compile seconds, recompiles, passes per road
              "engine": target.compile_stats() if hasattr(target, "compile_stats") else {"compile": "off"}}
    scores = _reference_scores(bench, questions, res)
    if scores:
        print(format_scores(bench.name, scores))
        record["scores"] = scores
        metrics.update({f"eval/{bench.name}/found/{name}": s["found"] / s["n"] for name, s in scores.items()})
    _log_to_wandb(loggers or [], res, metrics)
    return record, metrics


def eval_timing(cfg: DictConfig) -> str:
    """``eval.timing`` (default ``wall``), checked before anything decodes (with ``eval.engine``)."""
    from draftlab.eval.served import check_engine

    check_engine(cfg)
    timing = cfg.eval.get("timing", "wall")
    if timing not in TIMINGS:
        raise ConfigError(f"expected one of {', '.join(TIMINGS)}, got {timing!r}", field="eval.timing")
    return str(timing)


def _reference_scores(bench, questions, res) -> dict[str, dict[str, Any]]:
    """Reference-found scores of AR, the method and each baseline, for a bench that scores some categories
    (``bench.scored``); ``{}`` for the rest (Spec-Bench, MT-bench) and when no scored question ran."""
    scored = getattr(bench, "scored", None)
    if scored is None:
        return {}
    files = {AR_NAME: res.answer_files[AR_NAME], res.method: res.answer_files[res.method]}
    files.update({name: r.answer_files[name] for name, r in res.baselines.items()})
    return bench_scores(scored, questions, files)



def baseline_specs(cfg: DictConfig, main: MethodSpec, *, has_draft: bool) -> dict[str, MethodSpec]:
    """``eval.baselines`` as (name -> MethodSpec), checked before anything decodes: a trainable baseline
    needs the run to have a draft (``has_draft``) in the artifact format the run's method (``main``) writes."""
    specs = {}
    for name, method_cfg in (cfg.eval.get("baselines") or {}).items():
        if method_cfg is None:  # a baseline switched off from the command line (eval.baselines.pld=null)
            continue
        bspec = MethodSpec(method_cfg)
        if bspec.trainable:
            if not has_draft:
                raise ValueError(f"eval.baselines.{name}: method '{bspec.name}' needs a trained draft and method "
                                 f"'{main.name}' has none; a baseline of a training-free run must be a method "
                                 "with trainable: false")
            if OmegaConf.to_container(bspec.block("artifact"), resolve=True) != \
                    OmegaConf.to_container(main.block("artifact"), resolve=True):
                raise ValueError(f"eval.baselines.{name}: method '{bspec.name}' reads another artifact format than "
                                 f"method '{main.name}' (their 'artifact' blocks differ), so it cannot draft from "
                                 "this run's draft")
        specs[str(name)] = bspec
    return specs


def baseline_drafters(cfg: DictConfig, main: MethodSpec, draft=None, stack: ExitStack | None = None
                      ) -> tuple[dict[str, tuple[Any, GenerationConfig]], dict[str, MethodSpec]]:
    """``eval.baselines`` as (name -> (drafter, its GenerationConfig)), (name -> MethodSpec). A trainable
    baseline drafts from ``draft``, the run's trained draft. With ``stack`` each drafter is closed when the
    stack unwinds (those built before a failing one too); without it the caller closes them."""
    specs = baseline_specs(cfg, main, has_draft=draft is not None)
    drafters = {}
    for name, bspec in specs.items():
        drafter = bspec.build_drafter(draft) if bspec.trainable else bspec.build_drafter()
        if stack is not None:
            stack.callback(drafter.close)
        drafters[name] = (drafter, generation_config(cfg, drafter))
    return drafters, specs


def _log_to_wandb(loggers: list, res, metrics: dict[str, float]) -> None:
    run = tracking.wandb_run(loggers)
    if run is None:
        return
    import wandb

    run.log({k: v for k, v in metrics.items() if k.startswith("eval/")})
    from draftlab.eval.runner import report_groups

    cols = ["column", "n_questions", "tau", "tau_ci_lo", "tau_ci_hi", "speedup", "speedup_ci_lo", "speedup_ci_hi",
            "method_tps", "ar_tps"]
    groups = report_groups(res.metrics)
    table = wandb.Table(columns=cols, data=[[c] + [_cell(m, k) for k in cols[1:]] for c, m in groups.items()])
    # The run's headline numbers with their intervals, where runs are filtered and compared without opening them.
    run.summary.update({k: v for k, v in metrics.items() if k.startswith(f"eval/{res.bench}/AVG/")})
    hist = wandb.Table(columns=["accept_length", "rounds"], data=[[int(k), int(v)] for k, v in res.accept_histogram.items()])
    run.log({f"eval/{res.bench}/table": table,
             f"eval/{res.bench}/accept_lengths": wandb.plot.bar(hist, "accept_length", "rounds",
                                                                 title="accepted tokens per round")})


def _cell(group: dict, key: str):
    """A group's value, or one bound of its interval for ``<metric>_ci_lo`` / ``<metric>_ci_hi``."""
    if key.endswith(("_ci_lo", "_ci_hi")):
        ci = group.get(key[:-3])
        return None if not ci else ci[0 if key.endswith("_lo") else 1]
    return group.get(key)
