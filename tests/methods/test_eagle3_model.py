import pytest
import torch

from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.eagle3 import CacheAttention, CausalAttention, Eagle3Config, Eagle3Draft
from draftlab.nn import rope_inv_freq

D, DT, H, HKV, HD, FF, V, VD = 32, 16, 4, 2, 8, 64, 50, 20



def small_config(**kw) -> Eagle3Config:
    base = dict(hidden_size=D, intermediate_size=FF, num_heads=H, num_kv_heads=HKV, head_dim=HD, vocab_size=V,
                draft_vocab_size=VD, target_hidden_size=DT, aux_layer_ids=[1, 3, 5])
    base.update(kw)
    return Eagle3Config(**base)


def small_draft(seed: int = 0, dtype=torch.float32, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(small_config(**kw)).to(dtype)
    # Non-trivial norm weights so that variant switches visibly matter.
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return draft


def inputs(B=2, T=9, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * DT, generator=g, dtype=dtype)
    pos = torch.arange(T).expand(B, T)
    return ids, aux, pos


# Native EAGLE-3 / SpecForge / SGLang safetensors keys (reference section 1.6 (a)) for this config.
NATIVE_KEYS = {
    "fc.weight": (D, 3 * DT),
    "midlayer.input_layernorm.weight": (D,),
    "midlayer.hidden_norm.weight": (D,),
    "midlayer.self_attn.q_proj.weight": (H * HD, 2 * D),
    "midlayer.self_attn.k_proj.weight": (HKV * HD, 2 * D),
    "midlayer.self_attn.v_proj.weight": (HKV * HD, 2 * D),
    "midlayer.self_attn.o_proj.weight": (D, H * HD),
    "midlayer.post_attention_layernorm.weight": (D,),
    "midlayer.mlp.gate_proj.weight": (FF, D),
    "midlayer.mlp.up_proj.weight": (FF, D),
    "midlayer.mlp.down_proj.weight": (D, FF),
    "norm.weight": (D,),
    "lm_head.weight": (VD, D),
    "d2t": (VD,),
    "t2d": (V,),
}


def test_state_dict_is_the_native_export_layout():
    draft = Eagle3Draft(small_config())
    sd = draft.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items() if k != "embed_tokens.weight"} == NATIVE_KEYS
    assert tuple(sd["embed_tokens.weight"].shape) == (V, D)
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    assert int(sd["t2d"].sum()) == VD
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable == {k for k in NATIVE_KEYS if k.endswith(".weight")}  # embedding frozen


def test_variant_parameters_and_validation():
    keys = Eagle3Draft(small_config(fc_norm=True)).state_dict()
    assert [tuple(keys[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(DT,)] * 3
    keys = Eagle3Draft(small_config(norm_before_fc=True)).state_dict()
    assert tuple(keys["input_norm.weight"].shape) == (3 * DT,)
    with pytest.raises(ValueError, match="mutually exclusive"):
        small_config(fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match="exactly 3"):
        small_config(aux_layer_ids=[1, 2])
    keys = Eagle3Draft(small_config(num_layers=2)).state_dict()
    # Layers after the first read the d-dim stream only.
    assert tuple(keys["additional_layers.0.self_attn.q_proj.weight"].shape) == (H * HD, D)
    assert "additional_layers.0.hidden_norm.weight" not in keys
    assert small_config(target_hidden_size=None).target_hidden_size == D


def test_from_target_copies_geometry_embedding_and_mapping(tiny_target):
    cfg = Eagle3Config.from_target(tiny_target, draft_vocab_size=256)
    g = tiny_target.geometry
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 128, 4, 2, 16)
    assert cfg.vocab_size == g.vocab_size and cfg.target_hidden_size == 64 and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    assert cfg.aux_layer_ids == [0, 0, 1] and cfg.layer_convention == "output_of"
    # Asking for the other convention renames the same tensors.
    assert Eagle3Config.from_target(tiny_target, draft_vocab_size=256, layer_convention="input_to").aux_layer_ids == [1, 1, 2]
    assert Eagle3Config.from_target(tiny_target, draft_vocab_size=256, fc_norm=True).fc_norm

    freq = torch.zeros(g.vocab_size, dtype=torch.long)
    freq[torch.arange(100, 400)] = torch.arange(300, 0, -1)
    mapping = build_vocab_mapping(freq, 256)
    draft = Eagle3Draft.from_target(tiny_target, vocab_mapping=mapping)
    assert torch.equal(draft.embed_tokens.weight, tiny_target.model.get_input_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.d2t, mapping.d2t) and torch.equal(draft.t2d, mapping.t2d)
    assert torch.equal(draft.target_ids(), mapping.target_ids())


def test_rotary_matches_hf(tiny_target):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    pos = torch.tensor([[0, 1, 7, 100, 3000]])
    x = torch.zeros(1, 5, 16)
    draft = Eagle3Draft.from_target(tiny_target, draft_vocab_size=64)
    cos, sin = draft.rotary(pos, torch.float32)
    ref_cos, ref_sin = tiny_target.model.model.rotary_emb(x, pos)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=1e-5, atol=1e-5)

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                          max_position_embeddings=131072, rope_parameters=llama3))
    scaling = {k: v for k, v in llama3.items() if k != "rope_theta"}
    torch.testing.assert_close(rope_inv_freq(16, 500000.0, scaling).float(), hf.inv_freq, rtol=1e-6, atol=0)


def test_fc_runs_only_on_target_features():
    draft = small_draft()
    ids, aux, pos = inputs()
    h1, logits1 = draft.forward_step(ids, aux, pos)
    h2, logits2 = draft.forward_step(ids, draft.project(aux), pos)
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(logits1, logits2)
    assert h1.shape == (2, 9, D) and logits1.shape == (2, 9, VD)


def test_variants_change_the_computation():
    ids, aux, pos = inputs()
    base_h, base_logits = small_draft().forward_step(ids, aux, pos)
    for knob in ("fc_norm", "norm_before_fc", "norm_before_residual"):
        h, _ = small_draft(**{knob: True}).forward_step(ids, aux, pos)
        assert not torch.allclose(h, base_h), knob
    draft = small_draft(norm_output=False)
    h, logits = draft.forward_step(ids, aux, pos)
    torch.testing.assert_close(h, base_h)  # only the head input changes; the fed-back state is pre-norm
    torch.testing.assert_close(logits, draft.lm_head(h))


def test_rope_depends_on_relative_positions_only():
    draft = small_draft(dtype=torch.float64)
    ids, aux, pos = inputs(dtype=torch.float64)
    h1, _ = draft.forward_step(ids, aux, pos)
    h2, _ = draft.forward_step(ids, aux, pos + 37)
    torch.testing.assert_close(h1, h2)
    h3, _ = draft.forward_step(ids, aux, pos * 2)
    assert not torch.allclose(h1, h3)


def test_left_padding_is_masked_without_nans():
    draft = small_draft(dtype=torch.float64)
    ids, aux, _ = inputs(B=1, T=6, dtype=torch.float64)
    ref_h, ref_logits = draft.forward_step(ids, aux, torch.arange(6)[None])
    pad_ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    pad_aux = torch.cat([torch.randn(1, 2, 3 * DT, dtype=torch.float64) * 100, aux], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5]])
    h, logits = draft.forward_step(pad_ids, pad_aux, pos, CausalAttention(mask))
    assert torch.isfinite(h).all() and torch.isfinite(logits).all()
    torch.testing.assert_close(h[:, 2:], ref_h)
    torch.testing.assert_close(logits[:, 2:], ref_logits)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_kv_cache_incremental_equals_full_forward(num_layers):
    draft = small_draft(dtype=torch.float64, num_layers=num_layers)
    ids, aux, pos = inputs(B=2, T=8, dtype=torch.float64)
    ref_h, ref_logits = draft.forward_step(ids, aux, pos)

    cache = draft.new_cache(batch_size=2, max_length=16)
    h, logits = draft.forward_step(ids[:, :5], aux[:, :5], pos[:, :5], CacheAttention(cache))
    cache.commit(5)
    hs, ls = [h], [logits]
    for t in range(5, 8):
        h, logits = draft.forward_step(ids[:, t:t + 1], aux[:, t:t + 1], pos[:, t:t + 1], CacheAttention(cache))
        cache.commit(1)
        hs.append(h)
        ls.append(logits)
    torch.testing.assert_close(torch.cat(hs, 1), ref_h)
    torch.testing.assert_close(torch.cat(ls, 1), ref_logits)

    # Two sibling rows under an explicit tree mask: each sees the context and itself, not its sibling.
    cache.truncate(5)
    tree_mask = torch.ones(2, 7, dtype=torch.bool)
    tree_mask[0, 6] = tree_mask[1, 5] = False
    sib_ids = torch.stack([ids[:, 5], ids[:, 5].flip(0)], 1)  # [B, 2]
    sib_aux = aux[:, 5:6].expand(2, 2, 3 * DT)
    h, _ = draft.forward_step(sib_ids, sib_aux, torch.full((2, 2), 5), CacheAttention(cache, tree_mask))
    torch.testing.assert_close(h[:, 0], ref_h[:, 5])
    with pytest.raises(ValueError, match="attn_mask"):
        draft.forward_step(sib_ids, sib_aux, torch.full((2, 2), 5), CacheAttention(cache, tree_mask[:, :6]))
