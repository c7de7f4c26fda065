"""Opt-in: a draft reloaded into a running vLLM server (``serving/vllm_side/draft_reload.py``) is served exactly as
a fresh server started on the same export serves it.

Marked ``serving``; skipped unless ``DRAFTLAB_VLLM_PYTHON`` names a vLLM environment's python and
``DRAFTLAB_VLLM_DRAFT`` an EAGLE-3 export in vLLM's layout (``draftlab-export format=vllm``; a served check's
``<artifact dir>/served_eval/export`` is one). Two exports: the draft (A) and the draft with every weight
perturbed (B). One server starts on A and is asked; B is reloaded into it and asked; a fresh server starts on B
and is asked; A is reloaded into that one and asked. B's counters must equal between reload and fresh launch
(per prompt), A's likewise, A and B must differ (the reload changed something), and every answer must equal
the first (the target untouched)::

    DRAFTLAB_VLLM_PYTHON=/work/vllm-venv/bin/python DRAFTLAB_VLLM_DRAFT=<export> pytest -n 0 -m serving \\
        tests/serving/test_draft_reload_vllm.py
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.serving, pytest.mark.timeout(2400)]

VLLM_PYTHON = os.environ.get("DRAFTLAB_VLLM_PYTHON", "")
DRAFT = os.environ.get("DRAFTLAB_VLLM_DRAFT", "")
if not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK) and DRAFT and Path(DRAFT, "config.json").is_file()):
    pytest.skip("set DRAFTLAB_VLLM_PYTHON (a vLLM environment's python) and DRAFTLAB_VLLM_DRAFT (an EAGLE-3 "
                "vLLM export)", allow_module_level=True)

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "List three colours.",
           "Explain what a hash table is."]


def _perturbed(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(0)
    for f in dst.glob("*.safetensors"):
        tensors = {k: (v + 0.05 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
                   if v.is_floating_point() and "d2t" not in k and "t2d" not in k else v
                   for k, v in load_file(str(f)).items()}
        save_file(tensors, str(f))


def _reload(url: str, export: Path) -> None:
    body = json.dumps({"method": "draftlab_reload_draft", "args": [str(export)]}).encode()
    req = urllib.request.Request(url + "/collective_rpc", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status == 200


def _server(export: Path, tmp: Path, name: str):
    from draftlab.assets import fetch
    from draftlab.eval.served_callback import RELOAD_EXTENSION
    from draftlab.serving import ServerProcess, free_port, vllm_command

    side = Path(__file__).resolve().parents[2] / "src" / "draftlab" / "serving" / "vllm_side"
    port = free_port()
    cmd = vllm_command(fetch("smollm2-135m-instruct"), port=port, dtype="float32", max_model_len=1024,
                       served_model_name="target", python=VLLM_PYTHON,
                       speculative_config={"method": "eagle3", "model": str(export), "num_speculative_tokens": 3},
                       extra=["--enforce-eager", "--no-enable-prefix-caching", "--worker-extension-cls", RELOAD_EXTENSION])
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(side)}
    return ServerProcess(cmd, port=port, startup_timeout=1200, log_path=tmp / f"{name}.log", env=env)


def test_a_reloaded_draft_is_served_as_a_fresh_launch_serves_it(tmp_path):
    from draftlab.eval.served_metrics import query_server

    a, b = Path(DRAFT), tmp_path / "perturbed"
    _perturbed(a, b)
    ask = lambda url: query_server(url, PROMPTS, max_tokens=32, model="target")[0]  # noqa: E731
    with _server(a, tmp_path, "first") as server:
        a_fresh = ask(server.url)
        _reload(server.url, b)
        b_reloaded = ask(server.url)
    with _server(b, tmp_path, "second") as server:
        b_fresh = ask(server.url)
        _reload(server.url, a)
        a_reloaded = ask(server.url)
    per_prompt = lambda answers: [(x.counters.drafts, x.counters.accepted, x.counters.per_pos) for x in answers]  # noqa: E731
    assert per_prompt(b_reloaded) == per_prompt(b_fresh)
    assert per_prompt(a_reloaded) == per_prompt(a_fresh)
    assert per_prompt(a_fresh) != per_prompt(b_fresh)  # the perturbation shows: the reload did change the draft
    first = [x.token_ids for x in a_fresh]
    assert all([x.token_ids for x in run] == first for run in (b_reloaded, b_fresh, a_reloaded))
