"""Every committed table that draftlab-table made from committed records rebuilds from them byte for byte.

Each entry is (table file, draftlab-table arguments), paths relative to ``experiments/``, with the options of
the command that wrote it (the experiment's README or script, named beside each group).

Committed tables left out, because their records are not in the repository (only under ``runs/``):
  * ``confu/table1.{md,tex}``, ``confu/table4.{md,tex}``, ``confu/table6.{md,tex}``: the Table 1/4/6 sweeps
    under ``runs/confu`` (experiments/confu/README.md keeps only ``records/recipe_t0``).
  * ``smollm2_eagle3/regen_ttt7/table1.{md,tex}``: ``runs/recipe/grid`` and ``runs/recipe/pld`` of the earlier
    recipe.
Other tables under ``experiments/`` are written by the experiments' own scripts (``compare.py``,
``ablations.py``, ``report.py``, ``sweep.py``, ``categories.py``, ``curve.py``), not by draftlab-table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.table import main

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

# experiments/draft_opd/tables.sh: one row per arm, named with --name, in the script's arm order.
OPD_ARMS = (("sft", "SFT (start)"), ("sft_more", "SFT continued"), ("opd", "Draft-OPD"),
            ("opd_seed1", "Draft-OPD, seed 1"), ("opd_forward", "all forward KL"), ("opd_reverse", "all reverse KL"),
            ("opd_random", "random anchors"), ("opd_nodecay", "no decay"))
ANCHOR_ARMS = (("sft", "SFT (start)"), ("opd", "Draft-OPD (error anchors)"),
               ("opd_random", "random anchors (committed, all accepted)"),
               ("opd_random_rounds", "random verify rounds, 5 min"),
               ("opd_random_rounds_steps", "random verify rounds, 33 steps"))
INTERVAL_ARMS = (("sft", "SFT (start)"), ("sft_more", "SFT continued"), ("opd", "Draft-OPD"),
                 ("opd_random", "random anchors"))
JOINT_TABLE4 = ["--layout", "table4", "--cell", "joint"]


def _named(folder: str, prefix: str, arms) -> list[str]:
    return [a for arm, name in arms for a in (f"draft_opd/records/{folder}/{prefix}_{arm}.json", "--name", name)]


def _recipe_45min(prefix: str) -> list[str]:
    r = "draft_opd/records/recipe_45min"
    return [f"{r}/{prefix}_start.json", "--name", "recipe SFT (start)", f"{r}/{prefix}_sft_more.json", "--name",
            "SFT continued, 45 min", f"{r}/{prefix}_opd.json", "--name", "Draft-OPD, 45 min", *JOINT_TABLE4]


CONFU_RECIPE = ["confu/records/recipe_t0/eagle3", "confu/records/recipe_t0/eagle3_continue",
                "confu/records/recipe_t0/confu", "--layout", "table1"]          # confu/recipe_t0.sh
DFLASH = ["dflash/records/sweep", "dflash/records/eagle3", "--layout", "methods"]  # dflash/README.md
GRID = ["smollm2_eagle3/records/t0", "smollm2_eagle3/records/t0.7", "smollm2_eagle3/records/t1.0",
        "--layout", "methods"]                                                   # smollm2_eagle3/grid.sh, README
D = "draft_opd/records/dflash"
C = "draft_opd/records/recipe"

CONFU_INTERVALS = ["confu/records/recipe_t0_intervals/eagle3", "confu/records/recipe_t0_intervals/eagle3_continue",
                   "confu/records/recipe_t0_intervals/confu", "--layout", "table1", "--ci"]  # confu/README.md

CONFU_GRID = [f"confu/records/recipe_grid_intervals/{m}" for m in ("eagle3", "eagle3_continue", "confu")] + [
    "--layout", "table1", "--ci"]  # confu/README.md

OBJ = "objectives/records"


def _objectives(bench: str) -> list[str]:
    """objectives/tables.sh: every arm's record of ``bench``, in the order its shell glob lists them."""
    files = sorted(p.name for p in (EXPERIMENTS / OBJ).glob(f"{bench}_*.json"))
    return [*(f"{OBJ}/{f}" for f in files), "--layout", "methods", "--ci", "--cell", "joint"]


TABLES: list[tuple[str, list[str]]] = [
    ("objectives/table_specbench.md", _objectives("specbench")),
    ("objectives/table_gsm8k.md", _objectives("gsm8k")),
    ("confu/table1_recipe.md", CONFU_RECIPE),
    ("confu/table1_recipe.tex", [*CONFU_RECIPE, "--format", "latex"]),
    ("confu/table1_recipe_intervals.md", CONFU_INTERVALS),
    ("confu/table1_recipe_intervals.tex", [*CONFU_INTERVALS, "--format", "latex"]),
    ("confu/table1_grid_ci.md", CONFU_GRID),
    ("confu/table1_grid_ci.tex", [*CONFU_GRID, "--format", "latex"]),
    ("dflash/table.md", DFLASH),
    ("dflash/table.tex", [*DFLASH, "--format", "latex"]),
    ("draft_opd/table_specbench.md", [*_named("ablations", "eval", OPD_ARMS), *JOINT_TABLE4]),
    ("draft_opd/table_gsm8k.md", [*_named("ablations", "gsm8k", OPD_ARMS), *JOINT_TABLE4]),
    ("draft_opd/table_dflash.md", [f"{D}/eval_sft.json", f"{D}/eval_sft_more.json", f"{D}/eval_opd.json",
                                   f"{D}/gsm8k_sft.json", f"{D}/gsm8k_sft_more.json", f"{D}/gsm8k_opd.json",
                                   "--name", "DFlash SFT (start)", "--name", "DFlash SFT continued",
                                   "--name", "DFlash Draft-OPD", "--name", "DFlash SFT (start), GSM8K test",
                                   "--name", "DFlash SFT continued, GSM8K test",
                                   "--name", "DFlash Draft-OPD, GSM8K test", *JOINT_TABLE4]),
    ("draft_opd/table_recipe.md", [f"{C}/eval_recipe.json", "--name", "recipe SFT (start)",
                                   f"{C}/eval_recipe_sft_more.json", "--name", "SFT continued, 12 min",
                                   f"{C}/eval_recipe_opd.json", "--name", "Draft-OPD, 12 min", *JOINT_TABLE4]),
    ("draft_opd/table_recipe_45min_specbench.md", _recipe_45min("eval")),
    ("draft_opd/table_recipe_45min_gsm8k.md", _recipe_45min("gsm8k")),
    ("draft_opd/table_anchors_specbench.md", [*_named("anchors", "eval", ANCHOR_ARMS), *JOINT_TABLE4]),
    ("draft_opd/table_anchors_gsm8k.md", [*_named("anchors", "gsm8k", ANCHOR_ARMS), *JOINT_TABLE4]),
    ("draft_opd/table_intervals_specbench.md", [*_named("intervals", "eval", INTERVAL_ARMS), *JOINT_TABLE4, "--ci"]),
    ("draft_opd/table_intervals_gsm8k.md", [*_named("intervals", "gsm8k", INTERVAL_ARMS[:3]), *JOINT_TABLE4, "--ci"]),
    ("smollm2_eagle3/table_grid.md", GRID),
    ("smollm2_eagle3/table_grid.tex", [*GRID, "--format", "latex"]),
    ("smollm2_eagle3/table_gated.md", ["smollm2_eagle3/records/t0_1q_gated", "--layout", "methods",
                                       "--cell", "joint"]),                      # smollm2_eagle3/README.md
    ("specbound/table_t0.md", ["specbound/records/eval", "--layout", "methods"]),  # specbound/run.sh
    ("specbound/table_t0.tex", ["specbound/records/eval", "--layout", "methods", "--format", "latex"]),
    ("specbound/table_sweep.md", ["specbound/records/sweep", "--layout", "methods"]),
    ("specbound/table_sweep.tex", ["specbound/records/sweep", "--layout", "methods", "--format", "latex"]),
    ("quickstart/sweep_demo_table6.md", ["quickstart/records/sweep_demo", "--layout", "table6", "--ci",
                                         "--format", "markdown"]),                  # quickstart/README.md
    ("quickstart/sweep_demo_table1_ttt4.md", ["quickstart/records/sweep_demo", "--layout", "table1", "--ttt-length", "4",
                                              "--ci", "--format", "markdown"]),
    ("serving/served_table.md", ["serving/records/dflash_b6", "serving/records/recipe_eagle3",
                                 "--layout", "served"]),                        # serving/README.md
    ("serving/served_table_sampled.md", ["serving/records/quickstart_eagle3_t0.7", "serving/records/quickstart_eagle3_t1.0",
                                         "--layout", "served"]),                # serving/README.md section 14
    ("serving/records/concurrency_quickstart_eagle3.md", ["serving/records/concurrency_quickstart_eagle3.json",
                                                          "--layout", "served"]),  # serving/README.md section 10
]


def _argv(args: list[str]) -> list[str]:
    """Arguments with every record path made absolute (options and their values are kept as given)."""
    out = []
    for i, a in enumerate(args):
        is_value = i > 0 and args[i - 1].startswith("--")
        out.append(str(EXPERIMENTS / a) if not a.startswith("--") and not is_value else a)
    return out


def test_the_list_names_committed_files_only():
    """A stale entry would pass for the wrong reason: every table and every record path must exist."""
    for table, args in TABLES:
        assert (EXPERIMENTS / table).is_file(), table
        for a in _argv(args):
            assert not a.startswith(str(EXPERIMENTS)) or Path(a).exists(), a


@pytest.mark.parametrize("table, args", TABLES, ids=[t for t, _ in TABLES])
def test_committed_table_rebuilds_from_its_records(table, args, capsys):
    assert main(_argv(args)) == 0, capsys.readouterr().err
    rebuilt = capsys.readouterr().out
    assert rebuilt == (EXPERIMENTS / table).read_text(encoding="utf-8"), f"experiments/{table} differs when rebuilt"
