"""The shared building blocks: layer geometry checks and naming, RoPE from HF configs, simulated τ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftlab.methods.dflash import DFlashConfig
from draftlab.methods.eagle3 import Eagle3Config
from draftlab.nn import LlamaLayerGeometry, RMSNorm, Rotary, apply_rotary, rope_from_hf_config, simulated_tau


def test_geometry_refuses_inconsistent_heads_and_odd_head_dim():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaLayerGeometry(64, 128, num_heads=6, num_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LlamaLayerGeometry(64, 128, num_heads=4, num_kv_heads=2, head_dim=15)


@pytest.mark.parametrize("make", [
    lambda **g: Eagle3Config(**g, vocab_size=100, draft_vocab_size=50, target_hidden_size=32),
    lambda **g: DFlashConfig(**g, vocab_size=100, target_layer_ids=[1]),
])
def test_method_configs_share_the_geometry_checks_and_fields(make):
    fields = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    config = make(**fields)
    assert config.layer == LlamaLayerGeometry(**fields, rms_norm_eps=config.rms_norm_eps,
                                              rope_theta=config.rope_theta, rope_scaling=config.rope_scaling)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make(**{**fields, "num_kv_heads": 3})


def test_hf_fields_use_llama_names_in_a_fixed_order():
    g = LlamaLayerGeometry(64, 128, 4, 2, 16, rms_norm_eps=1e-6, rope_theta=5e5)
    assert list(g.hf_fields(3).items()) == [
        ("hidden_size", 64), ("intermediate_size", 128), ("num_attention_heads", 4), ("num_key_value_heads", 2),
        ("head_dim", 16), ("num_hidden_layers", 3), ("hidden_act", "silu"), ("rms_norm_eps", 1e-6),
        ("rope_theta", 5e5)]


def test_from_target_reads_sizes_and_hf_norm_and_rope_settings():
    hf = SimpleNamespace(rms_norm_eps=1e-6, rope_theta=5e5,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    target = SimpleNamespace(model=SimpleNamespace(config=hf), geometry=SimpleNamespace(
        hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16))
    g = LlamaLayerGeometry.from_target(target, default_eps=1e-5)
    assert g == LlamaLayerGeometry(64, 128, 4, 2, 16, 1e-6, 5e5, {"rope_type": "linear", "factor": 2.0})
    bare = SimpleNamespace(geometry=target.geometry)  # no HF config: method defaults, plain RoPE
    assert LlamaLayerGeometry.from_target(bare, default_eps=1e-5).fields()["rms_norm_eps"] == 1e-5
    assert rope_from_hf_config(None) == (10000.0, None)


def test_rotary_is_a_rotation_and_rmsnorm_normalises():
    rot = Rotary(8, 10000.0)
    cos, sin = rot(torch.arange(5)[None], torch.float64)  # [1, 1, 5, 8]
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    out = RMSNorm(8, 1e-6)(3 * x)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(1, 2, 5, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_simulated_tau_counts_the_bonus_token():
    assert simulated_tau([1.0, 0.5, 0.5]) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert simulated_tau([1.0, 0.5, 0.5], include_bonus=False) == pytest.approx(1.75)
    assert simulated_tau([]) == 1.0
