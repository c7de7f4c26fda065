"""A target moved or cast after construction: the fused weights, rotary tables and LM-head copy follow.

``meta`` stands in for a GPU (no memory, no device needed); a float64 round trip on the CPU is the move
that can also be run, and fp32 -> fp64 -> fp32 is lossless, so the forward must come back bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.targets import load_target
from draftlab.targets.base import PassRequest


def _fused(t) -> list[torch.Tensor]:
    return [w for layer in t._layers for w in layer.values() if isinstance(w, torch.Tensor)]


def _shares_fused_storage(t) -> bool:
    # The HF parameters are views of the fused matrices (one copy of each weight), as after construction.
    layer, w = t.model.model.layers[0], t._layers[0]
    return (layer.self_attn.q_proj.weight.data_ptr() == w["wqkv"].data_ptr()
            and layer.mlp.gate_proj.weight.data_ptr() == w["wgu"].data_ptr())


def _ids() -> torch.Tensor:
    return torch.randint(0, 5000, (1, 12), generator=torch.Generator().manual_seed(3))


def test_to_meta_moves_every_weight_and_cache():
    t = load_target("tiny_random")
    t.forward(_ids())  # builds the rotary tables on the CPU
    t.lm_head(torch.zeros(1, 1, t.geometry.hidden_size))  # and the CPU LM-head copy
    assert t.to("meta") is t
    assert t.device.type == "meta"
    assert {p.device.type for p in t.model.parameters()} == {"meta"}
    assert {w.device.type for w in _fused(t)} == {"meta"}
    assert t._rope is None and t._lm_head_t is None  # nothing left behind on the CPU


@pytest.mark.parametrize("move", ["target", "model"])
def test_a_dtype_round_trip_gives_the_same_forward(move):
    """``target.to`` and a bare ``target.model.to`` (noticed at the next forward) both re-fuse."""
    t = load_target("tiny_random")
    ids = _ids()
    before = t.forward(ids, request=PassRequest(aux=True))
    mover = t if move == "target" else t.model
    mover.to(dtype=torch.float64)
    wide = t.forward(ids)
    assert wide.logits.dtype == torch.float64 and t.dtype == torch.float64
    assert {w.dtype for w in _fused(t)} == {torch.float64}
    torch.testing.assert_close(wide.logits.float(), before.logits, rtol=1e-4, atol=1e-4)
    assert _shares_fused_storage(t)
    mover.to(dtype=torch.float32)
    after = t.forward(ids, request=PassRequest(aux=True))
    assert torch.equal(after.logits, before.logits) and torch.equal(after.aux_hidden, before.aux_hidden)
    assert _shares_fused_storage(t)
    # The single-row head (the CPU fast path) agrees with the forward's head after the moves, too.
    h = t.final_norm(t.forward_layers(t.embed(ids[:, :1]), 0, t.geometry.num_layers).hidden)
    torch.testing.assert_close(t.lm_head(h, norm=False), t.forward(ids[:, :1]).logits, rtol=0, atol=1e-5)


def test_to_accepts_a_dtype_name():
    t = load_target("tiny_random").to("cpu", "bfloat16")
    assert t.dtype == torch.bfloat16 and {w.dtype for w in _fused(t)} == {torch.bfloat16}
    assert t.forward(_ids()).logits.dtype == torch.bfloat16


# ---- the fp32 transposed LM-head copy: only where it pays (a CPU), and only once it is used ------------

def test_no_lm_head_copy_off_the_cpu():
    t = load_target("tiny_random", device="meta")
    assert t._lm_head_t is None
    t.lm_head(torch.zeros(1, 1, t.geometry.hidden_size, device="meta"))  # the GPU path: the weight as is
    assert t._lm_head_t is None


def test_the_cpu_lm_head_copy_is_made_by_its_first_use():
    t = load_target("tiny_random")
    assert t._lm_head_t is None  # a target that never decodes a single row never pays for it
    h = torch.randn(1, 1, t.geometry.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = t.lm_head(h, norm=False)
    assert t._lm_head_t is not None and t._lm_head_t.device.type == "cpu"
    torch.testing.assert_close(logits, torch.nn.functional.linear(h, t.model.lm_head.weight), rtol=0, atol=1e-5)
