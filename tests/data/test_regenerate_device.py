"""Regeneration with the model on another device than the CPU (``meta`` standing in for a GPU).

HF ``generate`` does not move its inputs: ids built on the CPU for a CUDA model fail every call. Those
failures must neither be silent (recorded per conversation, a run that "completes" with nothing) nor
happen at all: the inputs go where the weights are.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftlab.data.conversations import Conversation
from draftlab.data.regenerate import RegenConfig, regenerate

MISMATCH = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


class _MetaModel(torch.nn.Module):
    """Weights on ``meta``; ``generate`` refuses inputs elsewhere as a real model on a GPU would."""

    def __init__(self, eos: int, fail: str | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(2, 2, device="meta"), requires_grad=False)
        self.eos, self.fail, self.calls = eos, fail, 0

    def generate(self, input_ids, attention_mask, **kwargs):
        self.calls += 1
        if self.fail:
            raise RuntimeError(self.fail)
        for x in (input_ids, attention_mask):
            if x.device != self.w.device:
                raise RuntimeError(MISMATCH.replace("cuda:0", str(self.w.device)).replace("cpu", str(x.device)))
        B, W = input_ids.shape
        new = torch.tensor([[42, 43, self.eos]] * B)  # the stub's answer, returned on the host
        return torch.cat([torch.zeros(B, W, dtype=torch.long), new], dim=1)


class _Target:
    def __init__(self, tokenizer, model):
        self.tokenizer, self.model, self.name = tokenizer, model, "meta-stub"
        self.eos_token_ids = [tokenizer.eos_token_id]


def _convs(n: int = 3) -> list[Conversation]:
    return [Conversation(id=f"c{i}", messages=[{"role": "user", "content": f"question {i}"},
                                               {"role": "assistant", "content": "old"}]) for i in range(n)]


CFG = RegenConfig(temperature=0.0, max_new_tokens=3, batch_size=2)


def test_generate_gets_its_inputs_on_the_models_device(smollm2_tokenizer, tmp_path):
    model = _MetaModel(smollm2_tokenizer.eos_token_id)
    report = regenerate(_Target(smollm2_tokenizer, model), _convs(), tmp_path / "r.jsonl", CFG, progress=False)
    assert (report.success, report.error) == (3, 0), report
    assert model.calls == 2
    rec = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert rec["conversations"][-1]["role"] == "assistant" and rec["conversations"][-1]["content"] != "old"


def test_a_device_mismatch_ends_the_run_instead_of_failing_each_conversation(smollm2_tokenizer, tmp_path):
    model = _MetaModel(smollm2_tokenizer.eos_token_id, fail=MISMATCH)
    with pytest.raises(RuntimeError, match="same device"):
        regenerate(_Target(smollm2_tokenizer, model), _convs(), tmp_path / "r.jsonl", CFG, progress=False)
    errors = tmp_path / "r.errors.jsonl"
    assert not errors.exists() or errors.read_text() == ""  # nothing recorded against a conversation


def test_other_generation_errors_are_still_recorded_per_conversation(smollm2_tokenizer, tmp_path):
    model = _MetaModel(smollm2_tokenizer.eos_token_id, fail="CUDA out of memory. Tried to allocate 2.00 GiB")
    report = regenerate(_Target(smollm2_tokenizer, model), _convs(), tmp_path / "r.jsonl", CFG, progress=False)
    assert (report.success, report.error) == (0, 3) and report.retry_ids == ["c0", "c1", "c2"]
