"""Held-out τ against training time for continued SFT and Draft-OPD (the plateau of the paper's Figure 1).

    python experiments/draft_opd/curve.py --start DRAFT_DIR RUN [RUN ...] --name NAME [--name NAME ...] \
        --out experiments/draft_opd/curve [--override bench.per_category=1 ...]

RUN is a training artifact directory (``<artifacts>/<method>/<key>``) or a ``draftlab-train`` run directory
whose ``record.json`` names one. Its checkpoints are every ``step*.ckpt`` the trainer kept: train with
``callbacks.model_checkpoint.save_top_k=-1`` and a ``train_time_interval`` to keep one every few minutes
(``experiments/draft_opd/run.sh`` does). Each checkpoint's draft decodes the held-out questions at T=0 with
the evaluated drafter; its point is (training seconds from the checkpoint's Timer state, τ = new tokens /
verify rounds over all questions). The start draft is every series' point at 0 s.

τ at T=0 does not depend on timing, so points can be measured in any process or order. They are cached in
``<out>.json`` per checkpoint (re-running skips measured ones). Writes ``<out>.md`` and ``<out>.png``.
The decoding settings compose from the real ``conf/``: ``experiment=quickstart method=eagle3`` with the
overrides given (defaults: the 6-node tree the Draft-OPD arms roll out and are evaluated with, Spec-Bench
one question per category, 96 new tokens).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tqdm import tqdm

from analysis.markdown import markdown_table

DEFAULTS = ["experiment=quickstart", "method=eagle3", "method.drafter.tree=fixed", "method.drafter.nodes=6",
            "method.drafter.depth=3", "method.drafter.branching=3", "bench=specbench", "bench.per_category=1",
            "eval.max_new_tokens=96", "eval.temperature=0.0"]


def artifact_root(run: Path) -> Path:
    """The artifact directory of ``run`` (itself, or the one its ``record.json`` names)."""
    if (run / "checkpoints").is_dir():
        return run
    record = run / "record.json"
    if record.exists():
        draft = json.loads(record.read_text())["artifacts"]["draft"]
        return Path(draft).parent
    raise FileNotFoundError(f"{run}: neither an artifact directory (no checkpoints/) nor a run with record.json")


def checkpoints(root: Path) -> list[tuple[Path, int, float]]:
    """(path, global step, training seconds) of every kept ``step*.ckpt``, by step, and of the state training
    ended in: a time-interval checkpoint seldom falls on the end of ``max_time``, but a finished run's
    ``resume.ckpt`` (written at the end of its last epoch) holds it."""
    import torch

    out = []
    paths = sorted((root / "checkpoints").glob("step*.ckpt"))
    if (root / "train_summary.json").exists() and (root / "checkpoints" / "resume.ckpt").exists():
        paths.append(root / "checkpoints" / "resume.ckpt")
    for path in paths:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors stay on disk
        timer = ckpt.get("callbacks", {}).get("Timer")
        if timer is None:
            raise ValueError(f"{path}: no Timer state, so no training time (train with trainer.max_time set)")
        out.append((path, int(ckpt["global_step"]), float(timer["time_elapsed"]["train"])))
    out.sort(key=lambda p: p[1])
    return [p for i, p in enumerate(out) if i == 0 or p[1] > out[i - 1][1]]  # the end state may be a kept one


def draft_at(start, path: Path):
    """The start draft with the weights of the training checkpoint ``path`` (its ``draft.*`` entries): any
    base's checkpoint, since the module keeps the draft under ``draft``. Checkpoints carry no target
    weights, so the embedding stays the start draft's (the target's, frozen in training)."""
    import copy

    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    tensors = {k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}
    draft = copy.deepcopy(start)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if "embed" not in k]
    if missing or unexpected:
        raise ValueError(f"{path}: draft weights do not fit the start draft (missing {missing}, "
                         f"unexpected {unexpected})")
    return draft


def measure_tau(target, drafter, questions, gen) -> dict:
    """New tokens and verify rounds of ``drafter`` over ``questions`` (every turn)."""
    from draftlab.eval.turns import answer_question

    tokens = rounds = 0
    for q in tqdm(questions, desc="held-out questions", unit="question", leave=False):
        for turn in answer_question(target, q, drafter=drafter, cfg=gen):
            tokens += turn.stats.new_tokens
            rounds += turn.stats.rounds
    return {"new_tokens": tokens, "rounds": rounds, "tau": tokens / max(rounds, 1)}


def table_lines(series: dict[str, list[tuple[float, int, float]]], setting: str) -> list[str]:
    """The ``<out>.md`` lines: one row per (run, checkpoint) of ``series`` ({name: [(seconds, step, τ)]})."""
    rows = [[name, str(step), f"{sec / 60:.1f}", f"{tau:.3f}"] for name, pts in series.items()
            for sec, step, tau in pts]
    return [f"Held-out τ: {setting}, T=0, same drafter for every point.", "",
            *markdown_table(["run", "step", "training minutes", "held-out τ"], rows, "lrrr")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--name", action="append", required=True, help="one label per run, in order")
    ap.add_argument("--start", type=Path, required=True, help="the draft directory every run started from")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (key=value)")
    args = ap.parse_args()
    if len(args.name) != len(args.runs):
        ap.error(f"{len(args.runs)} runs but {len(args.name)} --name labels")

    from hydra.utils import instantiate

    from draftlab.configs import compose_train_config
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.evaluate import generation_config
    from draftlab.utils.atomic import atomic_write_text

    cfg = compose_train_config([*DEFAULTS, *args.override])
    target = instantiate(cfg.target)
    spec = MethodSpec(cfg.method)
    bench = instantiate(cfg.bench, _convert_="object")
    questions = bench.load(tokenizer=target.tokenizer)
    cache_path = args.out.with_suffix(".json")
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    settings = {"overrides": [*DEFAULTS, *args.override], "questions": [q.question_id for q in questions]}
    if cache.get("settings", settings) != settings:
        raise ValueError(f"{cache_path} was measured with other settings; use another --out or remove it")
    cache["settings"] = settings
    points: dict = cache.setdefault("points", {})

    def point(key: str, load) -> dict:
        if key not in points:
            draft = load().to(target.dtype).eval()
            drafter = spec.build_drafter(draft)
            points[key] = measure_tau(target, drafter, questions, generation_config(cfg, drafter))
            atomic_write_text(cache_path, json.dumps(cache, indent=2))  # resumable: one point at a time
        return points[key]

    start_draft = spec.load(args.start, target)
    start = point(f"start:{args.start.resolve()}", lambda: start_draft)
    series: dict[str, list[tuple[float, int, float]]] = {}
    for name, run in zip(args.name, args.runs):
        pts = [(0.0, 0, start["tau"])]
        for path, step, seconds in checkpoints(artifact_root(run)):
            key = f"{path.resolve()}@{os.path.getmtime(path):.0f}"
            pts.append((seconds, step, point(key, lambda p=path: draft_at(start_draft, p))["tau"]))
        series[name] = pts

    lines = table_lines(series, f"{len(questions)} questions ({bench.name}), {cfg.eval.max_new_tokens} new tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for name, pts in series.items():
        ax.plot([p[0] / 60 for p in pts], [p[2] for p in pts], marker="o", label=name)
    ax.set_xlabel("training time (minutes, from the same supervised start)")
    ax.set_ylabel("held-out τ (tokens per verify round)")
    ax.set_title(f"{bench.name}: {len(questions)} questions, {cfg.eval.max_new_tokens} tokens, T=0", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
