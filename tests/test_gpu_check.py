"""The prepared GPU check (experiments/gpu_check) in its CPU mode: every part runs at tiny sizes, so the script a
GPU machine runs cannot rot between the times one is available."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT, THREADS

SCRIPT = REPO_ROOT / "experiments" / "gpu_check" / "check.py"


def _script():
    """check.py as a module (its folder on the path: it imports its parts by name)."""
    import importlib.util

    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(tmp_path, shared_data, parts: str) -> dict:
    env = {"OMP_NUM_THREADS": str(THREADS), "DRAFTLAB_SHARED_DATA": str(shared_data)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), "--parts", parts,
                           "--carry", str(tmp_path / "no_carry")], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "summary.md").read_text().startswith("# GPU check")
    return json.loads((tmp_path / "results.json").read_text())["results"]


def _numbers(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("status", "seconds")}


# The two calls a lent machine gets, each at tiny sizes (Triton under its interpreter, TRITON_INTERPRET=1), as two
# tests so that CI's workers run them side by side.
def test_gpu_check_first_call_runs_the_kernel_parts_on_cpu(tmp_path, shared_data):
    results = _check(tmp_path, shared_data, "first")
    assert list(results) == ["env", "kernel_tests", "ttt_right", "ttt_fast", "soft_ce", "ttt_step"]  # priority order
    assert all(r["status"] == "passed" for r in results.values()), {n: r["status"] for n, r in results.items()}
    right = _numbers(results["ttt_right"])
    assert {f"hd16/{c}/{impl}" for c in ("bf16", "autocast_mix", "fp32", "right_padded", "left_padded", "rows_subset")
            for impl in ("blockwise", "triton")} <= set(right)  # every case for both paths
    assert all(r["max_rel_err"] <= r["threshold"] and not r["nan"] for r in right.values()), right
    assert {"torch", "blockwise", "triton_b16"} <= set(results["ttt_fast"]["T=48"])
    assert {"torch", "blockwise", "triton"} <= set(results["ttt_step"]["T=24"])
    assert all("ms" in r for r in results["ttt_step"]["T=24"].values()), results["ttt_step"]
    assert {"chunked", "triton"} <= set(_numbers(results["soft_ce"]))
    assert results["env"]["triton_interpreted"] is True


def test_gpu_check_second_call_runs_the_rest_on_cpu(tmp_path, shared_data):
    results = _check(tmp_path, shared_data, ",".join(p for p in _script().GROUPS["rest"] if p not in ("train", "engine")))
    status = {name: r["status"] for name, r in results.items()}
    # Only the part that needs CUDA itself is skipped on a CPU; every other part ran and passed.
    assert status == {"lossless": "passed", "bf16_greedy": "passed", "llama8b": "passed", "conformance": "passed",
                      "pytest_gpu": "skipped"}, status
    assert results["lossless"]["methods"]["eagle3"]["greedy_accepted"] > 0
    assert results["llama8b"]["decode"]["engine_ar_tok_s"] > 0


def test_gpu_check_train_part_on_cpu(tmp_path, shared_data):
    """The second call's ``train`` part on its own (two draftlab-train runs), so CI's workers share the call."""
    results = _check(tmp_path, shared_data, "train")
    assert results["train"]["status"] == "passed"
    assert {"online", "offline"} <= set(results["train"])
    assert results["train"]["online"]["draft_sha256"] != results["train"]["offline"]["draft_sha256"]


def test_gpu_check_engine_part_on_cpu(tmp_path, shared_data):
    """The second call's ``engine`` part on its own (it compiles), so CI's workers share the call."""
    results = _check(tmp_path, shared_data, "engine")
    engine = results["engine"]
    assert engine["status"] == "passed", engine
    assert engine["fp32_compiled_equals_eager"] is True
    assert engine["compiled_ar_tok_s"] > 0 and engine["bandwidth_bound_tok_s"] > 0
    assert engine["compile"]["compiled"] and engine["compile"]["recompiles"] == 0, engine["compile"]
    assert set(engine["fraction_of_bound"]) == {"eager", "compiled", "hf_generate"}


def test_the_two_calls_cover_every_part_in_priority_order():
    groups = _script().GROUPS
    assert groups["first"] == ["env", "kernel_tests", "ttt_right", "ttt_fast", "soft_ce", "ttt_step"]
    assert set(groups["rest"]) == {"lossless", "bf16_greedy", "llama8b", "engine", "train", "conformance",
                                   "pytest_gpu"}
    assert groups["all"] == groups["first"] + groups["rest"]


def test_gpu_check_rejects_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), "--parts", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown parts ['nope']" in proc.stderr
