"""The validators catch every corruption an engine would trip over, and name it."""

from __future__ import annotations

import pytest
import torch
from export_testlib import VD, edit_config, edit_tensors, tiny_draft

from draftlab.methods.eagle3.export import (
    check_valid,
    save_native,
    save_speculators,
    save_vllm,
    validate_native,
    validate_sglang,
    validate_speculators,
    validate_vllm,
)

FORMATS = {
    "native": (save_native, validate_native, "midlayer."),
    "vllm": (save_vllm, validate_vllm, "midlayer."),
    "speculators": (save_speculators, validate_speculators, "layers.0."),
}


@pytest.fixture(params=list(FORMATS))
def export(request, tmp_path):
    """(format, directory, validator, layer prefix) of a fresh, valid export."""
    fmt = request.param
    save, validate, prefix = FORMATS[fmt]
    draft = tiny_draft(num_layers=2) if fmt == "speculators" else tiny_draft()
    save(draft, tmp_path, max_position_embeddings=4096)
    assert validate(tmp_path) == []
    return fmt, tmp_path, validate, prefix


def problems_after(export, *, tensors=None, config=None) -> list[str]:
    _, path, validate, _ = export
    if tensors is not None:
        edit_tensors(path, tensors)
    if config is not None:
        edit_config(path, config)
    return validate(path)


def assert_flagged(problems: list[str], *needles: str) -> None:
    assert problems, "corruption went unnoticed"
    text = "\n".join(problems)
    for n in needles:
        assert n in text, f"{n!r} not named in:\n{text}"


def without(key):
    return lambda sd: {k: v for k, v in sd.items() if k != key}


@pytest.mark.parametrize("suffix", ["self_attn.q_proj.weight", "hidden_norm.weight", "mlp.down_proj.weight"])
def test_missing_layer_tensor(export, suffix):
    key = export[3] + suffix
    assert_flagged(problems_after(export, tensors=without(key)), f"missing tensor '{key}'")


@pytest.mark.parametrize("key", ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"])
def test_missing_core_tensor(export, key):
    assert_flagged(problems_after(export, tensors=without(key)), f"missing tensor '{key}'")


def test_wrong_shapes(export):
    q = export[3] + "self_attn.q_proj.weight"

    def corrupt(sd):
        sd[q] = sd[q][:, : sd[q].shape[1] // 2].contiguous()  # d-wide instead of 2d-wide
        sd["fc.weight"] = sd["fc.weight"][:-1].contiguous()
        return sd

    assert_flagged(problems_after(export, tensors=corrupt), f"tensor '{q}' has shape", "tensor 'fc.weight' has shape")


def test_shape_against_config(export):
    # Consistent tensors but a config that disagrees: the validator checks the file against its config.
    fmt = export[0]

    def shrink(cfg):
        (cfg["transformer_layer_config"] if fmt == "speculators" else cfg)["intermediate_size"] = 17

    assert_flagged(problems_after(export, config=shrink), "mlp.gate_proj.weight' has shape")


def test_d2t_not_increasing(export):
    def corrupt(sd):
        d2t = sd["d2t"].clone()
        d2t[3], d2t[4] = d2t[4] + 1, d2t[3] - 1  # swaps the target ids of draft ids 3 and 4
        return {**sd, "d2t": d2t}

    assert_flagged(problems_after(export, tensors=corrupt), "d2t + arange is not strictly increasing")


def test_d2t_out_of_range(export):
    def corrupt(sd):
        d2t = sd["d2t"].clone()
        d2t[-1] += 10_000
        return {**sd, "d2t": d2t}

    assert_flagged(problems_after(export, tensors=corrupt), "outside the target vocabulary")


def test_t2d_disagrees_with_d2t(export):
    def corrupt(sd):
        t2d = sd["t2d"].clone()
        target_of_0 = int(sd["d2t"][0])
        t2d[target_of_0] = False
        return {**sd, "t2d": t2d}

    assert_flagged(problems_after(export, tensors=corrupt), "t2d does not match d2t")


def test_mapping_dtypes(export):
    problems = problems_after(export, tensors=lambda sd: {**sd, "d2t": sd["d2t"].int(), "t2d": sd["t2d"].to(torch.uint8)})
    assert_flagged(problems, "'d2t' has dtype int32, expected int64", "'t2d' has dtype uint8, expected bool")


def test_wrong_architecture(export):
    assert_flagged(problems_after(export, config=lambda cfg: cfg.update(architectures=["LlamaForCausalLM"])),
                   "architectures is ['LlamaForCausalLM']")


def test_native_and_speculators_are_not_interchangeable(tmp_path):
    save_native(tiny_draft(), tmp_path / "n")
    save_speculators(tiny_draft(), tmp_path / "s")
    assert_flagged(validate_speculators(tmp_path / "n"), "Eagle3Speculator", "missing tensor 'layers.0.")
    assert_flagged(validate_native(tmp_path / "s"), "LlamaForCausalLMEagle3", "missing tensor 'midlayer.")


@pytest.mark.parametrize("prefix", ["draft.", "model.", "draft_model."])
def test_leftover_prefix(export, prefix):
    problems = problems_after(export, tensors=lambda sd: {prefix + k: v for k, v in sd.items()})
    assert_flagged(problems, f"tensor '{prefix}fc.weight' has a leftover '{prefix}' prefix", "missing tensor 'fc.weight'")


def test_unexpected_tensor(export):
    problems = problems_after(export, tensors=lambda sd: {**sd, "fc_norm.0.weight": torch.ones(4), "foo": torch.ones(1)})
    assert_flagged(problems, "unexpected tensor 'fc_norm.0.weight' (config fc_norm is false)", "unexpected tensor 'foo'")


@pytest.mark.parametrize("ids", [[1, 5], [1, 5, 5], [1, 5, 9, 12], [-1, 5, 9], "1,5,9", None])
def test_aux_ids(export, ids):
    fmt = export[0]

    def edit(cfg):
        if fmt == "native":
            if ids is None:
                cfg.pop("eagle_config")
            else:
                cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
            cfg.pop("draftlab")  # keep only the eagle_config problem
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
            cfg.pop("draftlab", None)
            cfg.pop("eagle_config", None)

    assert_flagged(problems_after(export, config=edit), "eagle_aux_hidden_state_layer_ids")


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "rms_norm_eps"])
def test_missing_config_key(export, key):
    fmt = export[0]

    def edit(cfg):
        (cfg["transformer_layer_config"] if fmt == "speculators" else cfg).pop(key)

    assert_flagged(problems_after(export, config=edit), f"missing required key '{key}'")


def test_draft_vocab_size_missing(export):
    assert_flagged(problems_after(export, config=lambda cfg: cfg.pop("draft_vocab_size")),
                   "missing required key 'draft_vocab_size'")


def test_torch_dtype_mismatch(export):
    assert_flagged(problems_after(export, config=lambda cfg: cfg.update(torch_dtype="bfloat16")),
                   "torch_dtype is 'bfloat16' but the weights are float32")


def test_speculators_requires_explicit_norm_before_residual(tmp_path):
    save_speculators(tiny_draft(), tmp_path)
    edit_config(tmp_path, lambda cfg: cfg.pop("norm_before_residual"))
    assert_flagged(validate_speculators(tmp_path), "missing required key 'norm_before_residual'")


def test_speculators_block(tmp_path):
    save_speculators(tiny_draft(), tmp_path)

    def edit(cfg):
        sc = cfg["speculators_config"]
        sc["algorithm"] = "eagle"
        sc["proposal_methods"][0]["speculative_tokens"] = 0
        sc["default_proposal_method"] = "tree"
        del sc["verifier"]

    edit_config(tmp_path, edit)
    assert_flagged(validate_speculators(tmp_path), "algorithm is 'eagle'", "speculative_tokens must be a positive",
                   "default_proposal_method 'tree'", "verifier must be an object")


def test_native_draftlab_block_must_agree(tmp_path):
    save_native(tiny_draft(), tmp_path)
    edit_config(tmp_path, lambda cfg: cfg["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 6, 10]))
    assert_flagged(validate_native(tmp_path), "eagle_config ids [2, 6, 10] are not the draftlab ids")


def test_vllm_ids_must_be_output_of_plus_one(tmp_path):
    """The vLLM variant's ids are checked as vLLM reads them: input_to = output_of + 1 of the draftlab ids."""
    save_vllm(tiny_draft(), tmp_path)  # draftlab ids [1, 5, 9] output_of
    # The old native spelling (output_of ids at the top level) would feed vLLM the layers one early.
    edit_config(tmp_path, lambda cfg: cfg.update(eagle_aux_hidden_state_layer_ids=[1, 5, 9]))
    assert_flagged(validate_vllm(tmp_path), "[1, 5, 9] are not the draftlab ids", "= [2, 6, 10]",
                   "eagle_config.eagle_aux_hidden_state_layer_ids [2, 6, 10] differs from the top-level")


def test_vllm_norm_output_must_be_false(tmp_path):
    save_vllm(tiny_draft(), tmp_path)
    edit_config(tmp_path, lambda cfg: cfg.update(norm_output=True))
    assert_flagged(validate_vllm(tmp_path), "'norm_output' is True; vLLM reads true as 'feed the post-norm")


def test_sglang_and_vllm_variants_are_not_interchangeable(tmp_path):
    """What main's native export wrote (output_of ids in eagle_config only, norm_output true) is not a vLLM
    directory, and the vLLM variant is not an SGLang one."""
    save_native(tiny_draft(), tmp_path / "s")
    save_vllm(tiny_draft(), tmp_path / "v")
    assert validate_sglang(tmp_path / "s") == [] and validate_vllm(tmp_path / "v") == []
    assert_flagged(validate_vllm(tmp_path / "s"), "eagle_aux_hidden_state_layer_ids (top level, read by vLLM): missing",
                   "'norm_output' is True", "written for 'sglang', not 'vllm'")
    assert_flagged(validate_sglang(tmp_path / "v"), "written for 'vllm', not 'sglang'",
                   "eagle_config ids [2, 6, 10] are not the draftlab ids", "'norm_output' is False")
    # validate_native follows the block.
    assert validate_native(tmp_path / "v") == [] and validate_native(tmp_path / "s") == []


def test_unreadable_directories(tmp_path):
    assert_flagged(validate_native(tmp_path / "nope"), "is not a directory")
    (tmp_path / "empty").mkdir()
    assert_flagged(validate_speculators(tmp_path / "empty"), "no config.json")
    save_native(tiny_draft(), tmp_path / "n")
    (tmp_path / "n" / "model.safetensors").write_bytes(b"\x00" * 16)
    assert_flagged(validate_native(tmp_path / "n"), "cannot read weights")
    (tmp_path / "n" / "model.safetensors").unlink()
    assert_flagged(validate_native(tmp_path / "n"), "no model.safetensors")
    (tmp_path / "n" / "config.json").write_text("{not json")
    assert_flagged(validate_native(tmp_path / "n"), "not valid JSON")


def test_check_valid_lists_every_problem(tmp_path):
    save_native(tiny_draft(), tmp_path)
    check_valid(tmp_path, "native")  # valid: no exception
    edit_tensors(tmp_path, lambda sd: {k: v for k, v in sd.items() if k not in ("norm.weight", "d2t")})
    edit_config(tmp_path, lambda cfg: cfg.update(architectures=["X"]))
    with pytest.raises(ValueError) as err:
        check_valid(tmp_path, "native")
    msg = str(err.value)
    assert "3 problems" in msg and "'norm.weight'" in msg and "'d2t'" in msg and "architectures" in msg
    with pytest.raises(ValueError, match="unknown export format"):
        check_valid(tmp_path, "gguf")


def test_valid_variants(tmp_path):
    for i, kw in enumerate([dict(fc_norm=True), dict(norm_before_fc=True, num_layers=3), dict(target_hidden_size=32),
                            dict(draft_vocab_size=VD // 2)]):
        draft = tiny_draft(**kw)
        save_native(draft, tmp_path / f"n{i}", dtype="float16")
        save_vllm(draft, tmp_path / f"v{i}", dtype="float16")
        save_speculators(draft, tmp_path / f"s{i}", dtype="bfloat16")
        assert validate_native(tmp_path / f"n{i}") == [], kw
        assert validate_vllm(tmp_path / f"v{i}") == [], kw
        assert validate_speculators(tmp_path / f"s{i}") == [], kw
