"""The training plan of the real targets' configs, computed without weights, and the draft vocabulary rule."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.configs import compose_train_config
from draftlab.methods.registry import MethodSpec, auto_draft_vocab_size, resolve_draft_vocab_size
from draftlab.targets.base import default_aux_layer_ids
from draftlab.targets.config_facts import target_hf_config


@pytest.fixture
def no_loading(monkeypatch):
    """Every way a target, its weights or its tokenizer could be loaded raises."""
    import transformers

    import draftlab.targets as targets
    import draftlab.targets.tiny as tiny
    from draftlab.targets.hf import HFTarget

    def refuse(*args, **kwargs):
        raise AssertionError("the plan must not load a target")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(targets, "load_target", refuse)
    monkeypatch.setattr(tiny, "tiny_random_target", refuse)
    monkeypatch.setattr(HFTarget, "from_pretrained", refuse)
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


def _plan(target: str, *overrides: str):
    from draftlab.stages.plan import training_plan

    return training_plan(compose_train_config([f"target={target}", "method=eagle3", *overrides]))


def _eagle3_params(d, inter, heads, kv, hd, vocab, draft_vocab):
    """An EAGLE-3 draft of one layer, counted by hand: fc (3d -> d), the midlayer (q/k/v read 2d, two input
    norms), the MLP, the final norm, lm_head (V_d rows) and the frozen embedding (V rows)."""
    attn = 2 * d * heads * hd + 2 * (2 * d * kv * hd) + heads * hd * d
    layer = attn + 3 * d * inter + 3 * d  # input_layernorm, hidden_norm, post_attention_layernorm
    trainable = 3 * d * d + layer + d + draft_vocab * d
    return trainable, vocab * d


# (target, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, dtype, draft vocab)
CASES = [
    ("llama3_8b", 4096, 32, 32, 8, 128, 14336, 128256, "bfloat16", 32000),
    ("qwen3_4b", 2560, 36, 32, 8, 128, 9728, 151936, "bfloat16", 32000),
    ("smollm2_135m", 576, 30, 9, 3, 64, 1536, 49152, "float32", 8192),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_of_a_real_target_config_needs_no_weights(no_loading, case):
    name, d, layers, heads, kv, hd, inter, vocab, dtype, draft_vocab = case
    plan = _plan(name)
    t = plan["target"]
    assert (t["hidden_size"], t["num_layers"], t["num_heads"], t["num_kv_heads"], t["head_dim"],
            t["intermediate_size"], t["vocab_size"], t["dtype"]) == (d, layers, heads, kv, hd, inter, vocab, dtype)
    assert plan["draft_vocab"] == {"configured": "auto", "resolved": draft_vocab, "auto_would_be": draft_vocab}
    assert plan["taps"] == default_aux_layer_ids(layers, "output_of") == [1, layers // 2 - 1, layers - 4]
    draft = plan["draft"]
    assert draft["draft_vocab_size"] == draft_vocab and draft["fc_in_features"] == 3 * d
    trainable, frozen = _eagle3_params(d, inter, heads, kv, hd, vocab, draft_vocab)
    assert draft["parameters"] == {"total": trainable + frozen, "trainable": trainable, "frozen_embedding": frozen,
                                   "lm_head": draft_vocab * d}
    f = plan["features"]
    per_value = 2 if dtype == "bfloat16" else 4
    assert f["dtype"] == dtype and f["bytes_per_value"] == per_value
    assert f["row_width"] == 4 * d and f["bytes_per_token"] == 4 * d * per_value  # 3 taps + the final state
    assert f["tokens_at_most"] == 256 * 2048 and f["bytes_at_most"] == 256 * 2048 * f["bytes_per_token"]
    from draftlab.methods.eagle3.ttt import _TargetSide

    assert plan["teacher"]["chunk_rows"] == _TargetSide.CHUNK_ELEMENTS // vocab


def test_plan_numbers_of_the_8b_target(no_loading):
    plan = _plan("llama3_8b")
    assert plan["taps"] == [1, 15, 28]
    assert plan["draft"]["parameters"]["trainable"] == 424_689_664  # ~0.42 B, as EAGLE-3's LLaMA-3.1-8B head
    assert plan["features"]["bytes_per_token"] == 16384 * 2
    assert plan["teacher"]["chunk_rows"] == 523  # 2^26 // 128,256
    # An explicit number still wins, and the features follow the forced dtype.
    forced = _plan("llama3_8b", "method.draft_vocab_size=16000", "method.features.dtype=float32")
    assert forced["draft_vocab"]["resolved"] == 16000 and forced["draft"]["parameters"]["lm_head"] == 16000 * 4096
    assert forced["features"]["bytes_per_token"] == 16384 * 4


def test_plan_cli_prints_the_plan(no_loading, capsys):
    from draftlab.stages.plan import main

    main(["target=llama3_8b", "method=eagle3"])
    out = capsys.readouterr().out
    assert "draft_vocab_size: 32,000" in out and "taps: [1, 15, 28]" in out and "bytes_per_token: 32,768" in out


def test_tiny_target_config_matches_the_loaded_target(tiny_target):
    facts = target_hf_config(compose_train_config(["target=tiny_random"]).target)
    assert facts.geometry == tiny_target.geometry


def test_the_draft_vocabulary_rule():
    assert auto_draft_vocab_size(128256) == auto_draft_vocab_size(151936) == auto_draft_vocab_size(100_000) == 32000
    assert auto_draft_vocab_size(99_999) == auto_draft_vocab_size(49152) == 8192
    assert auto_draft_vocab_size(4000) == 4000
    assert resolve_draft_vocab_size("auto", 49152) == 8192 and resolve_draft_vocab_size(512, 128256) == 512
    assert resolve_draft_vocab_size(None, 128256) is None
    with pytest.raises(ValueError):
        resolve_draft_vocab_size("auto", None)


def _spec(*overrides: str) -> tuple:
    cfg = compose_train_config(["target=tiny_random", "method=eagle3", *overrides])
    return cfg, MethodSpec(cfg.method)


def test_auto_keys_equal_the_number_it_stands_for():
    """On the tiny / SmolLM2 vocabulary (49,152) ``auto`` is 8,192: the training key, the vocabulary map's key
    and the run config's method block are those of an explicit 8192; another number changes them."""
    from draftlab.data.vocab import vocab_mapping_cache_key
    from draftlab.stages.train import train_key

    facts = target_hf_config(compose_train_config(["target=tiny_random"]).target)
    assert facts.geometry.vocab_size == 49152
    cfg, spec = _spec()
    assert spec.needs_vocab_size
    with pytest.raises(ValueError, match="auto"):
        train_key(cfg, "data", spec)  # never a key with 'auto' in it
    spec.for_target(facts)
    assert cfg.method.draft_vocab_size == 8192 and spec.draft_vocab_size == 8192  # resolved in the run config
    explicit_cfg, explicit = _spec("method.draft_vocab_size=8192")
    other_cfg, other = _spec("method.draft_vocab_size=4096")
    assert train_key(cfg, "data", spec) == train_key(explicit_cfg, "data", explicit)
    assert train_key(cfg, "data", spec) != train_key(other_cfg, "data", other)

    def vkey(s):
        return vocab_mapping_cache_key("data", "template", "tiny_random", 2048, s.draft_vocab_size)

    assert vkey(spec) == vkey(explicit) != vkey(other)
    # What the evaluation key and the run record read: the run config's method block, resolved.
    method = [OmegaConf.to_container(c.method, resolve=True) for c in (cfg, explicit_cfg, other_cfg)]
    assert method[0] == method[1] != method[2]


def test_nested_method_configs_resolve_too():
    """A base (Draft-OPD) and an SSD base that inherit EAGLE-3's ``auto`` get the number as well."""
    for method in ("draft_opd", "ssd_eagle3", "confu"):
        cfg = compose_train_config(["target=llama3_8b", f"method={method}"])
        spec = MethodSpec(cfg.method)
        assert spec.needs_vocab_size, method
        spec.resolve_draft_vocab(128256)
        assert not spec.needs_vocab_size and spec.draft_vocab_size == 32000, method
    # MethodSpec.from_name resolves from the target's config (no target is loaded).
    assert MethodSpec.from_name("eagle3").draft_vocab_size == 8192
    assert MethodSpec.from_name("dflash").draft_vocab_size is None


def test_data_stage_with_auto_reuses_the_8192_vocabulary_map(tmp_path, monkeypatch):
    """Through the entry points' composition: ``auto`` on the tiny target (the SmolLM2 vocabulary) becomes 8192 in
    the run config, and a run asking for 8192 explicitly finds its vocabulary map instead of building one."""
    import draftlab.data.vocab as vocab_module
    from tests.test_configs import _compose

    base = ["target=tiny_random", "debug=default", "regen.max_new_tokens=4", "data.sources.sharegpt.limit=4",
            f"paths.artifacts={tmp_path / 'artifacts'}"]
    cfg = _compose(base, tmp_path)
    assert cfg.method.draft_vocab_size == "auto"
    first = _data_stage(cfg)
    assert cfg.method.draft_vocab_size == 8192 and first.vocab.d2t.numel() == 8192

    def refuse(*args, **kwargs):
        raise AssertionError("the vocabulary map of draft_vocab_size=auto was not reused")

    monkeypatch.setattr(vocab_module, "build_vocab_mapping", refuse)
    explicit = _data_stage(_compose([*base, "method.draft_vocab_size=8192"], tmp_path))
    assert explicit.data_key == first.data_key and torch.equal(explicit.vocab.d2t, first.vocab.d2t)


def _data_stage(cfg):
    """The data stage for ``cfg``'s method, as the pipeline runs it."""
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.data import run_data_stage

    return run_data_stage(cfg, MethodSpec(cfg.method))
