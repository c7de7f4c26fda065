"""``conf/method/dflash.yaml`` through the method registry, and the defaults on the embedded SmolLM2 target."""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.dflash import DFlashDraft, DFlashDrafter, build_draft
from draftlab.methods.dflash.data import DFlashDataModule
from draftlab.methods.dflash.module import DFlashModule


def test_every_seam_builds_from_the_config(tiny_target, tmp_path):
    from draftlab.methods.registry import MethodSpec

    spec = MethodSpec.from_name("dflash", ["method.draft.block_size=4", "method.draft.num_layers=1"])
    assert spec.trainable and spec.draft_vocab_size is None and spec.taps is None
    draft = spec.build_draft(tiny_target, None)
    assert isinstance(draft, DFlashDraft) and draft.config.block_size == 4 and draft.config.num_layers == 1
    assert isinstance(spec.build_module(draft, tiny_target), DFlashModule)
    assert isinstance(spec.build_datamodule([], features=None, pad_token_id=2, seed=0), DFlashDataModule)
    loaded = spec.load(spec.save(draft, tmp_path / "art", tiny_target), tiny_target)
    assert loaded.config == draft.config
    spec.exporters["dflash"](draft, tmp_path / "exp", target=tiny_target)
    drafter = spec.build_drafter(loaded)
    assert isinstance(drafter, DFlashDrafter) and drafter.scratch_rows(None) == 4
    prompt = list(range(200, 210))
    cfg = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
    assert speculative_generate(tiny_target, prompt, drafter, cfg)[0] == ref


def test_explicit_taps_are_read_in_the_targets_convention(tiny_target):
    draft = build_draft(tiny_target, taps=[1, 0], num_layers=1, block_size=3)
    assert draft.taps(tiny_target) == [1, 0] and draft.fc.weight.shape[1] == 2 * 64
    with pytest.raises(ValueError, match="out of range"):
        build_draft(tiny_target, taps=[5], num_layers=1, block_size=3)
    with pytest.raises(ValueError, match="draft_vocab_size: null"):
        build_draft(tiny_target, vocab=object())


@pytest.mark.slow
def test_smollm2_defaults(smollm2):
    draft = build_draft(smollm2, num_layers=2, block_size=8, seed=0)
    c = draft.config
    assert c.target_layer_ids == [1, 8, 14, 20, 27] and c.hidden_size == 576 and c.num_target_layers == 30
    assert smollm2.tokenizer.convert_ids_to_tokens(c.mask_token_id) == "<empty_output>"
    prompt = smollm2.tokenizer("The capital of France is")["input_ids"]
    cfg = GenerationConfig(max_new_tokens=10, stop_on_eos=False)
    with torch.no_grad():
        out, stats = speculative_generate(smollm2, prompt, DFlashDrafter(draft), cfg)
    assert out == autoregressive_generate(smollm2, prompt, cfg)[0] and set(stats.tree_sizes) == {8}
