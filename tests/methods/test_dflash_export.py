"""The DFlash HF export: the public format's keys, validate -> load round trip, specific failures, atomicity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab.methods.dflash import build_draft
from draftlab.methods.dflash.blocks import block_logits, make_blocks
from draftlab.methods.dflash.export import load, save, validate
from draftlab.targets.base import PassRequest

BS = 4


@pytest.fixture(scope="module")
def draft(tiny_target):
    d = build_draft(tiny_target, num_layers=2, block_size=BS, seed=0)
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped tensor shows in the outputs
        for p in d.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return d


@pytest.fixture()
def exported(draft, tiny_target, tmp_path):
    return save(draft, tmp_path / "dflash", target=tiny_target)


def _outputs(draft, target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (1, 16), generator=g)  # [1, T]
    ones = torch.ones_like(ids)
    blocks = make_blocks(ids, ones, ones, block_size=BS, mask_token_id=draft.config.mask_token_id,
                         anchors=torch.tensor([[3, 9]]))
    aux = target.forward(ids, request=PassRequest(aux=draft.taps(target), logits_rows=torch.arange(0))).aux_hidden
    return block_logits(draft, aux, blocks)


def _rewrite_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_config_follows_the_dflash_format(exported, draft, tiny_target):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    c = draft.config
    assert cfg["dflash_config"] == {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                                    "block_size": BS}
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == tiny_target.geometry.num_layers
    assert cfg["hidden_size"] == 64 and cfg["head_dim"] == 16 and cfg["block_size"] == BS
    keys = set(load_file(str(exported / "model.safetensors")))
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "layers.1.self_attn.k_norm.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    # The reference loader builds its layers from a Qwen3Config of this file.
    from transformers import Qwen3Config

    q = Qwen3Config.from_dict(cfg)
    assert q.head_dim == 16 and q.num_key_value_heads == 2 and q.rope_parameters["rope_theta"] == c.rope_theta
    assert not list(exported.parent.glob(".dflash.*"))  # no temporary directory left behind


def test_export_validate_load_round_trip(exported, draft, tiny_target):
    assert validate(exported, target=tiny_target) == []
    loaded = load(exported, target=tiny_target)
    assert loaded.config == draft.config
    assert torch.equal(_outputs(loaded, tiny_target), _outputs(draft, tiny_target))


def test_build_draft_continues_an_artifact_and_names_a_clash(exported, draft, tiny_target):
    """``method.draft.init.from``: on-policy training starts from a trained draft, built as configured."""
    continued = build_draft(tiny_target, num_layers=2, block_size=BS, init={"from": str(exported)})
    assert continued.config == draft.config
    assert torch.equal(_outputs(continued, tiny_target), _outputs(draft, tiny_target))
    with pytest.raises(ValueError, match=r"init.from=.*block_size"):
        build_draft(tiny_target, num_layers=2, block_size=BS + 2, init={"from": str(exported)})


def test_a_plain_dflash_config_loads_without_the_draftlab_block(exported, draft, tiny_target):
    _rewrite_config(exported, lambda cfg: cfg.pop("draftlab"))
    assert validate(exported, target=tiny_target) == []
    loaded = load(exported, target=tiny_target)
    assert loaded.config.target_layer_ids == draft.config.target_layer_ids  # output_of on both sides
    assert torch.allclose(_outputs(loaded, tiny_target), _outputs(draft, tiny_target))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: _rewrite_weights(p, lambda t: t.pop("layers.1.self_attn.q_norm.weight")),
     "missing tensor 'layers.1.self_attn.q_norm.weight'"),
    (lambda p: _rewrite_weights(p, lambda t: t.update({"embed_tokens.weight": torch.zeros(49152, 64)})),
     "unexpected tensor 'embed_tokens.weight' (the target's embedding / LM head must not be exported"),
    (lambda p: _rewrite_weights(p, lambda t: t.update({"fc.weight": torch.zeros(64, 128)})),
     "tensor 'fc.weight' has shape (64, 128), the config needs (64, 320)"),
    (lambda p: _rewrite_config(p, lambda c: c["dflash_config"].update(mask_token_id=10 ** 6)),
     "dflash_config 'mask_token_id' 1000000 is outside the vocabulary"),
    (lambda p: _rewrite_config(p, lambda c: c["dflash_config"].pop("target_layer_ids")),
     "dflash_config 'target_layer_ids' must be a non-empty list of integers"),
    (lambda p: _rewrite_config(p, lambda c: c.update(architectures=["LlamaForCausalLMEagle3"])),
     "'architectures' must list 'DFlashDraftModel'"),
    (lambda p: _rewrite_config(p, lambda c: c.update(intermediate_size=96)),
     "draftlab block intermediate_size=128 disagrees with config.json (96)"),
    (lambda p: (p / "model.safetensors").write_bytes(b"not a safetensors file"), "cannot read"),
])
def test_a_corrupted_export_fails_validation_with_a_specific_message(exported, tiny_target, corrupt, message):
    corrupt(exported)
    problems = validate(exported, target=tiny_target)
    assert any(message in p for p in problems), problems
    with pytest.raises(ValueError, match="not a valid DFlash export"):
        load(exported, target=tiny_target)


def test_the_target_is_checked(exported):
    from draftlab.targets import load_target

    other = load_target("tiny_random", num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    problems = validate(exported, target=other)
    assert any("hidden_size 64 != the target's 32" in p for p in problems)
    assert any("num_target_layers 2 != the target's 3 layers" in p for p in problems)


def test_saving_is_atomic(draft, tiny_target, tmp_path):
    out = tmp_path / "art"
    save(draft, out, target=tiny_target)
    before = (out / "model.safetensors").read_bytes()
    bad = build_draft(tiny_target, num_layers=2, block_size=BS, seed=1)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        save(bad, out, target=tiny_target)
    assert (out / "model.safetensors").read_bytes() == before  # the old export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    good = build_draft(tiny_target, num_layers=2, block_size=BS, seed=2)
    save(good, out, target=tiny_target)  # replacing an existing export
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
