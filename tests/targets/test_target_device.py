"""A target built for a device is wholly on it (checked with ``meta``: no memory, no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from draftlab.targets import load_target


def test_tiny_random_is_built_on_the_device_asked_for():
    t = load_target("tiny_random", device="meta")
    assert t.device.type == "meta"
    assert {p.device.type for p in t.model.parameters()} == {"meta"}
    # The fused per-layer weights the verify passes read, too (they are built from the model's own).
    fused = [w for layer in t._layers for w in layer.values() if isinstance(w, torch.Tensor)]
    assert fused and {w.device.type for w in fused} == {"meta"}


# ---- tiny_random of any Llama shape, with a tokenizer from a local directory ---------------------------

SMOLLM2_135M = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536)
LLAMA_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                vocab_size=128256)


@pytest.mark.parametrize("shape", [SMOLLM2_135M, LLAMA_8B], ids=["smollm2-135m", "llama-8b"])
def test_tiny_random_takes_real_shapes_on_meta(shape):
    t = load_target("tiny_random", device="meta", dtype="bfloat16", **shape)
    g = t.geometry
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads, g.intermediate_size) == (
        shape["num_layers"], shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"], shape["intermediate_size"])
    hd = shape["hidden_size"] // shape["num_heads"]  # 64 and 128
    assert g.head_dim == hd and g.vocab_size == shape.get("vocab_size", len(t.tokenizer))
    kv = shape["num_kv_heads"] * hd
    assert t._layers[0]["wqkv"].shape == (shape["hidden_size"] + 2 * kv, shape["hidden_size"])
    assert t._layers[0]["wgu"].shape == (2 * shape["intermediate_size"], shape["hidden_size"])
    assert {p.device.type for p in t.model.parameters()} == {"meta"} and t.dtype == torch.bfloat16


def test_tiny_random_reads_a_local_tokenizer_without_fetching(tmp_path, monkeypatch):
    load_target("tiny_random", device="meta").tokenizer.save_pretrained(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("the asset was fetched although a local tokenizer was given")

    monkeypatch.setattr("draftlab.assets.fetch", no_network)
    t = load_target("tiny_random", device="meta", tokenizer=str(tmp_path))
    assert len(t.tokenizer) == t.geometry.vocab_size and t.chat_template


def test_tiny_random_vocab_size_and_init_range():
    t = load_target("tiny_random", vocab_size=50000, initializer_range=0.02)
    assert t.geometry.vocab_size == 50000 and t.model.lm_head.weight.shape[0] == 50000
    std = t.model.model.layers[0].self_attn.q_proj.weight.std().item()
    default = load_target("tiny_random").model.model.layers[0].self_attn.q_proj.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.1) and default == pytest.approx(0.2, rel=0.1)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        load_target("tiny_random", device="meta", vocab_size=100)


def test_only_the_hf_backend_exists_in_process():
    # Serving engines are servers (draftlab.serving), not target backends: a name other than hf is refused,
    # with where to look instead.
    from draftlab.targets import load_target

    with pytest.raises(ValueError, match="known: hf; serving engines run as servers"):
        load_target("tiny_random", backend="sglang")
