"""Native and speculators exports: exact layouts, conventions, and lossless round trips."""

from __future__ import annotations

import json

import pytest
import torch
from export_testlib import AUX, FF, HD, HKV, VD, D, H, V, draft_outputs, edit_config, edit_tensors, tiny_draft
from safetensors import safe_open

from draftlab.methods.eagle3.export import (
    load_native,
    load_speculators,
    save_native,
    save_speculators,
    save_vllm,
    validate_native,
    validate_speculators,
    validate_vllm,
)
from draftlab.targets.base import LayerConvention, to_convention

# Reference section 1.6 (a): native keys and shapes for d_t = d.
NATIVE_LAYOUT = {
    "fc.weight": (D, 3 * D),
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
# Reference section 1.6 (b): the same tensors with the decoder layer renamed to layers.0.
SPECULATORS_LAYOUT = {k.replace("midlayer.", "layers.0."): s for k, s in NATIVE_LAYOUT.items()}

VARIANTS = {
    "default": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "two_layers": {"num_layers": 2},
    "input_to": {"aux_layer_ids": [2, 6, 10], "layer_convention": "input_to"},
    "narrow_target_llama3_rope": {"target_hidden_size": 32, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
}


def file_layout(path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}


def assert_same_draft(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    for x, y in zip(draft_outputs(a), draft_outputs(b)):
        assert torch.equal(x, y)


def output_of(config) -> list[int]:
    return [to_convention(i, config.layer_convention, LayerConvention.OUTPUT_OF) for i in config.aux_layer_ids]


# ------------------------------------------------------------------------------------------------------
# layouts


def test_native_layout_matches_the_reference(tmp_path):
    save_native(tiny_draft(), tmp_path)
    layout = file_layout(tmp_path)
    assert {k: s for k, (s, _) in layout.items()} == NATIVE_LAYOUT
    assert layout["d2t"][1] == torch.int64 and layout["t2d"][1] == torch.bool
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (
        D, FF, H, HKV, HD, 1, V, VD)
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"
    assert cfg["target_hidden_size"] == D and cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-5
    for key in ("fc_norm", "norm_before_fc", "norm_before_residual"):
        assert cfg[key] is False
    assert cfg["norm_output"] is True
    assert "rope_scaling" not in cfg  # plain RoPE
    assert cfg["draftlab"]["layer_convention"] == "output_of"
    assert cfg["draftlab"]["eagle3_config"] == tiny_draft().config.to_dict()
    assert cfg["draftlab"]["engine"] == "sglang" and "eagle_aux_hidden_state_layer_ids" not in cfg


def test_vllm_layout(tmp_path):
    """The vLLM variant: the native tensors, ids where every vLLM build looks (input_to), norm_output false."""
    save_vllm(tiny_draft(), tmp_path)
    assert {k: s for k, (s, _) in file_layout(tmp_path).items()} == NATIVE_LAYOUT
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 6, 10]  # AUX [1, 5, 9] output_of, + 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6, 10]
    assert cfg["norm_output"] is False and cfg["norm_before_residual"] is False
    block = cfg["draftlab"]
    assert block["engine"] == "vllm" and block["eagle_config_layer_convention"] == "input_to"
    assert block["norm_output_meaning"] == "post_norm_state_fed_back"
    assert block["eagle3_config"] == tiny_draft().config.to_dict()  # norm_output True: the final norm applies


def test_speculators_layout_matches_the_reference(tmp_path):
    save_speculators(tiny_draft(), tmp_path, verifier_name_or_path="org/target",
                     verifier_architectures=["LlamaForCausalLM"], speculative_tokens=5)
    assert {k: s for k, (s, _) in file_layout(tmp_path).items()} == SPECULATORS_LAYOUT
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert isinstance(cfg["speculators_version"], str)
    tl = cfg["transformer_layer_config"]
    assert (tl["model_type"], tl["hidden_size"], tl["intermediate_size"], tl["num_attention_heads"],
            tl["num_key_value_heads"], tl["head_dim"], tl["num_hidden_layers"], tl["vocab_size"]) == (
        "llama", D, FF, H, HKV, HD, 1, V)
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == D
    assert cfg["embed_requires_grad"] is False and cfg["norm_output"] is False
    assert cfg["norm_before_fc"] is False and cfg["fc_norm"] is False
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
    }


def test_extra_layers_and_fc_norm_keys(tmp_path):
    draft = tiny_draft(num_layers=3, fc_norm=True)
    save_native(draft, tmp_path / "n")
    save_speculators(draft, tmp_path / "s")
    native, spec = file_layout(tmp_path / "n"), file_layout(tmp_path / "s")
    for j in range(3):
        assert native[f"fc_norm.{j}.weight"][0] == spec[f"fc_norm.{j}.weight"][0] == (D,)
    for i in (1, 2):
        # Later layers read the d-dim stream only: d-wide q/k/v and no hidden_norm.
        assert native[f"additional_layers.{i - 1}.self_attn.q_proj.weight"][0] == (H * HD, D)
        assert spec[f"layers.{i}.self_attn.k_proj.weight"][0] == (HKV * HD, D)
        assert f"additional_layers.{i - 1}.hidden_norm.weight" not in native
        assert f"layers.{i}.hidden_norm.weight" not in spec
    assert not any(k.startswith(("midlayer.", "additional_layers.")) for k in spec)
    assert not any(k.startswith("layers.") for k in native)
    # vLLM maps only midlayer. (to layers.0.): its variant names the later layers as vLLM does.
    save_vllm(draft, tmp_path / "v")
    vllm = file_layout(tmp_path / "v")
    assert {k for k in vllm if "layers." in k} == {k.replace("additional_layers.0.", "layers.1.").replace(
        "additional_layers.1.", "layers.2.") for k in native if "layers." in k}


def test_norm_before_fc_key(tmp_path):
    save_native(tiny_draft(norm_before_fc=True), tmp_path)
    assert file_layout(tmp_path)["input_norm.weight"][0] == (3 * D,)


def test_embedding_only_on_request(tmp_path):
    draft = tiny_draft()
    save_native(draft, tmp_path / "without")
    save_native(draft, tmp_path / "with", include_embedding=True)
    save_speculators(draft, tmp_path / "spec_with", include_embedding=True)
    assert "embed_tokens.weight" not in file_layout(tmp_path / "without")
    assert file_layout(tmp_path / "with")["embed_tokens.weight"][0] == (V, D)
    assert file_layout(tmp_path / "spec_with")["embed_tokens.weight"][0] == (V, D)


# ------------------------------------------------------------------------------------------------------
# conventions and explicit switches


@pytest.mark.parametrize("convention", ["output_of", "input_to"])
def test_aux_ids_are_written_in_each_formats_convention(tmp_path, convention):
    ids = AUX if convention == "output_of" else [i + 1 for i in AUX]
    draft = tiny_draft(aux_layer_ids=ids, layer_convention=convention)
    save_native(draft, tmp_path / "n")
    save_vllm(draft, tmp_path / "v")
    save_speculators(draft, tmp_path / "s")
    native = json.loads((tmp_path / "n" / "config.json").read_text())
    vllm = json.loads((tmp_path / "v" / "config.json").read_text())
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    # The same three tensors: output_of for SGLang (first id 1 = the default), input_to for vLLM / speculators.
    assert native["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5, 9]
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 6, 10]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 6, 10]
    assert native["draftlab"]["layer_convention"] == convention
    assert native["draftlab"]["eagle3_config"]["aux_layer_ids"] == ids
    assert native["draftlab"]["eagle_config_layer_convention"] == "output_of"


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_norm_before_residual_is_always_explicit(tmp_path, nbr):
    save_speculators(tiny_draft(norm_before_residual=nbr), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["norm_before_residual"] is nbr
    assert load_speculators(tmp_path, require_embedding=False).config.norm_before_residual is nbr


def test_speculators_rejects_a_draft_without_final_norm(tmp_path):
    with pytest.raises(ValueError, match="norm_output"):
        save_speculators(tiny_draft(norm_output=False), tmp_path)
    with pytest.raises(ValueError, match="norm_output"):
        save_vllm(tiny_draft(norm_output=False), tmp_path)


def test_max_position_embeddings_from_verifier_or_argument(tmp_path, tiny_target):
    draft = tiny_draft()
    want = tiny_target.model.config.max_position_embeddings
    save_native(draft, tmp_path / "v", verifier=tiny_target)
    save_native(draft, tmp_path / "x", max_position_embeddings=777)
    cfg_v = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg_v["max_position_embeddings"] == want
    assert cfg_v["draftlab"]["verifier"] == "tiny_random"
    assert json.loads((tmp_path / "x" / "config.json").read_text())["max_position_embeddings"] == 777
    # Every writer takes it from the target: a Target, its HF config, or a directory with its config.json.
    save_vllm(draft, tmp_path / "vl", target=tiny_target.model.config)  # the method registry's keyword
    save_speculators(draft, tmp_path / "sp", verifier=tiny_target)
    tiny_target.model.config.save_pretrained(tmp_path / "target")
    save_speculators(draft, tmp_path / "sd", verifier=tmp_path / "target", max_position_embeddings=None)
    assert json.loads((tmp_path / "vl" / "config.json").read_text())["max_position_embeddings"] == want
    for name in ("sp", "sd"):
        spec = json.loads((tmp_path / name / "config.json").read_text())
        assert spec["transformer_layer_config"]["max_position_embeddings"] == want


# ------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_round_trip(tmp_path, variant):
    draft = tiny_draft(**VARIANTS[variant])
    save_native(draft, tmp_path, include_embedding=True)
    assert validate_native(tmp_path) == []
    back = load_native(tmp_path)
    assert back.config == draft.config  # exact, through the draftlab block
    assert_same_draft(draft, back)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_round_trip(tmp_path, variant):
    draft = tiny_draft(**VARIANTS[variant])
    save_vllm(draft, tmp_path, include_embedding=True)
    assert validate_vllm(tmp_path) == []
    back = load_native(tmp_path)
    assert back.config == draft.config  # exact, through the draftlab block
    assert_same_draft(draft, back)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_round_trip(tmp_path, variant):
    draft = tiny_draft(**VARIANTS[variant])
    save_speculators(draft, tmp_path, include_embedding=True)
    assert validate_speculators(tmp_path) == []
    back = load_speculators(tmp_path)
    assert back.config.layer_convention == "input_to"
    assert output_of(back.config) == output_of(draft.config)  # the same tensors, renamed
    same = {**back.config.to_dict(), "aux_layer_ids": draft.config.aux_layer_ids,
            "layer_convention": draft.config.layer_convention}
    assert same == draft.config.to_dict()
    assert_same_draft(draft, back)


def test_dtype_cast_keeps_mapping_buffers(tmp_path):
    draft = tiny_draft()
    save_native(draft, tmp_path / "n", dtype="bfloat16", include_embedding=True)
    save_speculators(draft, tmp_path / "s", dtype=torch.bfloat16)
    for p in (tmp_path / "n", tmp_path / "s"):
        layout = file_layout(p)
        assert layout["fc.weight"][1] == torch.bfloat16
        assert layout["d2t"][1] == torch.int64 and layout["t2d"][1] == torch.bool
        assert json.loads((p / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_native(tmp_path / "n")
    assert back.fc.weight.dtype == torch.bfloat16
    assert torch.equal(back.fc.weight, draft.fc.weight.to(torch.bfloat16))
    assert torch.equal(back.d2t, draft.d2t)
    assert torch.equal(load_native(tmp_path / "n", dtype="float32").lm_head.weight,
                       draft.lm_head.weight.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------------
# embedding sources and strict loading


def target_sized_draft(tiny_target):
    g = tiny_target.geometry
    return tiny_draft(vocab_size=g.vocab_size, hidden_size=g.hidden_size)


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_embedding_from_target(tmp_path, tiny_target, fmt):
    draft = target_sized_draft(tiny_target)
    draft.load_target_embedding(tiny_target)
    save, load = (save_native, load_native) if fmt == "native" else (save_speculators, load_speculators)
    save(draft, tmp_path)
    with pytest.raises(ValueError, match="embed_tokens.weight.*target"):
        load(tmp_path)
    back = load(tmp_path, target=tiny_target)
    assert_same_draft(draft, back)
    # A deferred target is built only when needed.
    assert_same_draft(draft, load(tmp_path, target=lambda: tiny_target))
    blank = load(tmp_path, require_embedding=False)
    assert torch.isnan(blank.embed_tokens.weight).all()


def test_embedding_in_file_wins_over_target(tmp_path, tiny_target):
    draft = target_sized_draft(tiny_target)  # random embedding, not the target's
    save_native(draft, tmp_path, include_embedding=True)
    back = load_native(tmp_path, target=tiny_target)
    assert torch.equal(back.embed_tokens.weight, draft.embed_tokens.weight)


def test_strict_loading_names_missing_and_unexpected_keys(tmp_path):
    save_native(tiny_draft(), tmp_path, include_embedding=True)

    def corrupt(sd):
        sd.pop("midlayer.mlp.up_proj.weight")
        sd["extra.weight"] = torch.zeros(3)
        return sd

    edit_tensors(tmp_path, corrupt)
    with pytest.raises(ValueError, match=r"missing keys \['midlayer.mlp.up_proj.weight'\].*unexpected keys "
                                         r"\['extra.weight'\]"):
        load_native(tmp_path)


def test_shape_mismatch_is_a_clear_error(tmp_path):
    save_native(tiny_draft(), tmp_path, include_embedding=True)
    edit_tensors(tmp_path, lambda sd: {**sd, "lm_head.weight": torch.zeros(VD + 1, D)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_native(tmp_path)


# ------------------------------------------------------------------------------------------------------
# foreign checkpoints


def strip_to_specforge(path) -> None:
    """Turn a draftlab native export into what SpecForge ships: no draftlab block, optional keys dropped."""

    def edit(cfg):
        for key in ("draftlab", "fc_norm", "norm_before_fc", "norm_before_residual", "head_dim"):
            cfg.pop(key, None)

    edit_config(path, edit)


def test_loads_a_plain_specforge_checkpoint(tmp_path, tiny_target):
    draft = tiny_draft(fc_norm=True)
    save_native(draft, tmp_path, include_embedding=True)
    strip_to_specforge(tmp_path)
    back = load_native(tmp_path)
    assert back.config.layer_convention == "output_of" and back.config.aux_layer_ids == AUX
    assert back.config.fc_norm  # inferred from the fc_norm.* tensors
    assert back.config.to_dict() == draft.config.to_dict()
    assert_same_draft(draft, back)

    # Without eagle_config the engines' defaults for the target's depth apply (output_of).
    edit_config(tmp_path, lambda cfg: cfg.pop("eagle_config"))
    L = tiny_target.geometry.num_layers
    from draftlab.targets.base import default_aux_layer_ids

    assert load_native(tmp_path, target=tiny_target).config.aux_layer_ids == default_aux_layer_ids(L, "output_of")
    assert load_native(tmp_path).config.aux_layer_ids == []


def test_loads_a_plain_vllm_style_config(tmp_path):
    """Without a draftlab block, top-level ids are vLLM's (input_to) and norm_output is vLLM's feedback switch."""
    draft = tiny_draft()
    save_vllm(draft, tmp_path, include_embedding=True)
    edit_config(tmp_path, lambda cfg: cfg.pop("draftlab"))
    back = load_native(tmp_path)
    assert back.config.layer_convention == "input_to" and back.config.aux_layer_ids == [2, 6, 10]
    assert output_of(back.config) == AUX and back.config.norm_output is True
    assert_same_draft(draft, back)
    edit_config(tmp_path, lambda cfg: cfg.update(norm_output=True))
    with pytest.raises(ValueError, match="post-norm"):
        load_native(tmp_path)


def test_speculators_missing_norm_before_residual_reads_as_true(tmp_path):
    save_speculators(tiny_draft(), tmp_path)
    edit_config(tmp_path, lambda cfg: cfg.pop("norm_before_residual"))
    assert load_speculators(tmp_path, require_embedding=False).config.norm_before_residual is True


def test_speculators_post_norm_feedback_is_refused(tmp_path):
    save_speculators(tiny_draft(), tmp_path)
    edit_config(tmp_path, lambda cfg: cfg.update(norm_output=True))
    with pytest.raises(ValueError, match="norm_output"):
        load_speculators(tmp_path, require_embedding=False)


def test_native_full_vocab_without_mapping_buffers(tmp_path):
    # EAGLE drops d2t/t2d when the draft keeps the full vocabulary.
    draft = tiny_draft(draft_vocab_size=V)
    save_native(draft, tmp_path, include_embedding=True)
    edit_tensors(tmp_path, lambda sd: {k: v for k, v in sd.items() if k not in ("d2t", "t2d")})
    back = load_native(tmp_path)
    assert torch.equal(back.target_ids(), torch.arange(V))
