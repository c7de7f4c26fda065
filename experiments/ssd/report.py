"""SSD's tables and plot from its evaluation records and calibrations (experiments/ssd/README.md).

    python experiments/ssd/report.py --one-core experiments/ssd/records/t0 experiments/ssd/records/t07 \
        --two-cores experiments/ssd/records/t0_2cores experiments/ssd/records/t07_2cores \
        --calibration experiments/ssd/calibration/t0.json experiments/ssd/calibration/t07.json \
        --out experiments/ssd
    python experiments/ssd/report.py --one-core experiments/ssd/records/eagle3_t0 experiments/ssd/records/eagle3_t07 \
        --two-cores experiments/ssd/records/eagle3_t0_2cores experiments/ssd/records/eagle3_t07_2cores \
        --calibration experiments/ssd/calibration/eagle3_t0.json experiments/ssd/calibration/eagle3_t07.json \
        --out experiments/ssd --suffix _eagle3

Writes ``table_speed.md`` (τ, tok/s and SR of AR, synchronous SD and every SSD variant, target on one core;
AR and SD on both cores), ``table_model.md`` (per SSD variant: hit rate, tokens per round on hits and misses,
cache-build and backup time in verify units, Saguaro's speed-up model beside the measured SR) and
``table_fanout.md`` + ``hit_rate_fanout.png`` (hit rate against fan-out, uniform vs geometric at equal budget,
from the calibration's outcomes, with the hit rates the SSD runs measured).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from analysis.markdown import markdown_table
from analysis.results import eval_answer_files
from draftlab.eval.uncertainty import speedup_interval, speedup_of, tau_interval, tau_of
from draftlab.methods.ssd.calibration import Calibration
from draftlab.methods.ssd.saguaro import geometric_fanout, uniform_fanout
from draftlab.utils.atomic import atomic_write_text


def _answers(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _ci(value, ci) -> str:
    if value is None:
        return "–"
    return f"{value:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{value:.2f}"


def _rows_of(ev: dict, name: str) -> list[dict]:
    return ev["questions"] if name == ev["method"] else ev["baselines"][name]["questions"]


def _labels(ev: dict) -> dict[str, str]:
    out = {ev["method"]: ev["label"]}
    out.update({k: v["label"] for k, v in (ev.get("baselines") or {}).items()})
    return out


def _per_token(answers: list[dict]) -> float:
    """Seconds per new token over the answers (wall time, prefill excluded)."""
    wall = sum(sum(c["wall_time"]) - sum(c.get("prefill_time", [0])) for a in answers for c in a["choices"])
    return wall / sum(sum(c["new_tokens"]) for a in answers for c in a["choices"])


def speed_table(one_core: list[str], two_cores: list[str]) -> list[str]:
    lines = []
    for i, run in enumerate(one_core):
        ev, files = eval_answer_files(run)
        ar_s = _per_token(_answers(files["ar"]))
        rows = [["AR", "1", "1.00", f"{1 / ar_s:.1f}", "1.00"]]
        for name, label in _labels(ev).items():
            r = _rows_of(ev, name)
            cores = "1 + worker" if _uses_worker(_answers(files[name])) else "1"
            rows.append([label, cores, _ci(tau_of(r), tau_interval(r)), f"{1 / _per_token(_answers(files[name])):.1f}",
                         _ci(speedup_of(r), speedup_interval(r))])
        if i < len(two_cores):
            ev2, files2 = eval_answer_files(two_cores[i])
            ar2 = _per_token(_answers(files2["ar"]))
            rows.append(["AR", "2", "1.00", f"{1 / ar2:.1f}", f"{ar_s / ar2:.2f}*"])
            for name, label in _labels(ev2).items():
                r2 = _rows_of(ev2, name)
                rows.append([label, "2", _ci(tau_of(r2), tau_interval(r2)), f"{1 / _per_token(_answers(files2[name])):.1f}",
                             f"{speedup_of(r2) * ar_s / ar2:.2f}*"])
        lines += [f"### T = {ev['temperature']} ({len(ev['questions'])} questions, {ev['max_new_tokens']} new tokens)", "",
                  *markdown_table(["setting", "cores", "τ [95 %]", "tok/s", "SR vs AR on 1 core [95 %]"], rows, "lrrrr"),
                  ""]
    lines.append("SR: per question against the AR run of the same process (paired bootstrap over questions); `*`: a "
                 "ratio of two processes' speeds (2-core run over the 1-core AR), no interval.")
    return lines


def _composed(run: str) -> dict:
    """The run's composed config (its record's ``config``)."""
    return json.loads((Path(run) / "record.json").read_text())["config"]


def _uses_worker(answers: list[dict]) -> bool:
    """Whether a run's drafter looked up a speculation cache (SSD with a worker; ``worker: none`` never does)."""
    return any(d and d.get("lookups") for a in answers for c in a["choices"] for d in (c.get("drafter_stats") or []))


def _sum(stats: list[dict], key: str) -> float:
    return float(sum(s.get(key, 0) for s in stats))


def model_table(one_core: list[str]) -> list[str]:
    """Saguaro's model: speed-up = (p E_hit + (1-p) E_miss) / (p max(1, T_p) + (1-p)(1 + T_b)) in verify units,
    turned into SR vs AR by the ratio of an AR step to a verify pass."""
    rows = []
    for run in one_core:
        ev, files = eval_answer_files(run)
        ar_s = _per_token(_answers(files["ar"]))
        for name, label in _labels(ev).items():
            answers = _answers(files[name])
            stats = [d for a in answers for c in a["choices"] for d in (c.get("drafter_stats") or []) if d]
            if not stats or not _uses_worker(answers):
                continue
            verify = sum(sum(c["verify_time"]) for a in answers for c in a["choices"])
            rounds = sum(sum(c["decoding_steps"]) for a in answers for c in a["choices"])
            t_v = verify / rounds
            lookups, hits = _sum(stats, "lookups"), _sum(stats, "hits")
            p = hits / lookups if lookups else 0.0
            e_hit = _sum(stats, "tokens_hit") / max(1.0, _sum(stats, "rounds_hit"))
            e_miss = _sum(stats, "tokens_miss") / max(1.0, _sum(stats, "rounds_miss"))
            t_p = _sum(stats, "build_s") / max(1.0, lookups) / t_v
            t_b = _sum(stats, "backup_s") / max(1.0, _sum(stats, "rounds_miss")) / t_v
            blocked = _sum(stats, "blocked_s") / max(1.0, lookups) / t_v
            model = (p * e_hit + (1 - p) * e_miss) / (p * max(1.0, t_p) + (1 - p) * (1 + t_b))
            measured = speedup_of(_rows_of(ev, name))
            rows.append([f"T = {ev['temperature']}", label, f"{p:.2f}", f"{e_hit:.2f}", f"{e_miss:.2f}", f"{t_p:.2f}",
                         f"{t_b:.2f}", f"{blocked:.2f}", f"{t_v / ar_s:.2f}", f"{model * ar_s / t_v:.2f}",
                         f"{measured:.2f}"])
    head = ["T", "setting", "hit rate", "E_hit", "E_miss", "T_p", "T_b", "blocked", "verify / AR step", "model SR",
            "measured SR"]
    return [*markdown_table(head, rows, "llrrrrrrrrr"), "",
            "E: tokens per round (accepted + bonus) on hits / misses (the first round of each answer is a miss). "
            "T_p: the worker's cache-build time per round, T_b: backup drafting per miss, blocked: time the engine "
            "waited on the worker per round, all in units of this run's mean verify pass. Model SR: Saguaro's "
            "speed-up (p E_hit + (1-p) E_miss) / (p max(1, T_p) + (1-p)(1 + T_b)) in verify units, times AR step / "
            "verify pass; measured SR: the run's."]


def fanout_table(calibrations: list[str], one_core: list[str], out: Path, suffix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured: dict[float, list[tuple[int, float, str]]] = {}
    for run in one_core:
        ev, files = eval_answer_files(run)
        for name, label in _labels(ev).items():
            stats = [d for a in _answers(files[name]) for c in a["choices"] for d in (c.get("drafter_stats") or []) if d]
            if stats and _uses_worker(_answers(files[name])) and "fast" not in name:
                cfg = (ev.get("baselines") or {}).get(name, {}).get("method_config", {}).get("drafter") or \
                    _composed(run)["eval"]["baselines"][name]["drafter"]
                # candidates / per_position (records before the naming pass: budget / width)
                per_position = cfg.get("per_position", cfg.get("width", 0))
                budget = cfg.get("candidates", cfg.get("budget")) if cfg.get("fanout") == "geometric" else \
                    per_position * (cfg.get("depth", 0) + 1)
                measured.setdefault(float(ev["temperature"]), []).append(
                    (budget, _sum(stats, "hits") / max(1.0, _sum(stats, "lookups")), label))
    lines, fig, ax = [], *plt.subplots(figsize=(6, 4))
    for path in calibrations:
        cal = Calibration.load(path)
        k, rows = cal.depth, []
        budgets, uni, geo = [], [], []
        for width in range(1, 7):
            budget = width * (k + 1)
            g = geometric_fanout(budget, k, accept=cal.accept, r=cal.power)
            budgets.append(budget)
            uni.append(cal.hit_rate(uniform_fanout(width, k)))
            geo.append(cal.hit_rate(g))
            rows.append([str(budget), f"{uni[-1]:.3f}", f"{geo[-1]:.3f}", str(g)])
        lines += [f"### T = {cal.temperature}: {cal.rounds} rounds, a = {cal.accept:.3f}, r = {cal.power:.3f}", "",
                  *markdown_table(["budget (branches)", "uniform", "geometric", "geometric fan-out"], rows, "rrrl"),
                  ""]
        ax.plot(budgets, uni, "o-", label=f"uniform, T={cal.temperature}")
        ax.plot(budgets, geo, "s--", label=f"geometric, T={cal.temperature}")
        for budget, hit, label in measured.get(float(cal.temperature), []):
            ax.scatter([budget], [hit], marker="x", s=60, color="k")
            ax.annotate(f"{label} (run)", (budget, hit), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xlabel("fan-out budget (branches built per round)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"hit_rate_fanout{suffix}.png", dpi=120)
    lines.append("Hit rates from the calibration's measured outcomes (plain SD on ShareGPT prompts): the share of rounds "
                 "whose (j, bonus) a cache with that fan-out holds. Crosses in the plot: the SSD runs' own hit rates "
                 "on Spec-Bench.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-core", nargs="+", required=True)
    ap.add_argument("--two-cores", nargs="*", default=[])
    ap.add_argument("--calibration", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suffix", default="", help="table_speed<suffix>.md, ... (one set of tables per primary)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"table_{t}{args.suffix}.md" for t in ("speed", "model", "fanout")]
    atomic_write_text(out / names[0], "\n".join(speed_table(args.one_core, args.two_cores)) + "\n")
    atomic_write_text(out / names[1], "\n".join(model_table(args.one_core)) + "\n")
    if args.calibration:
        atomic_write_text(out / names[2], "\n".join(fanout_table(args.calibration, args.one_core, out, args.suffix)) + "\n")
    for name in names:
        if (out / name).exists():
            print((out / name).read_text())


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
