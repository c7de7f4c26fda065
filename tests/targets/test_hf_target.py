import pytest
import torch

from draftlab.targets import (
    LayerConvention,
    default_aux_layer_ids,
    load_target,
    to_convention,
    to_hf_hidden_index,
)
from draftlab.targets.base import PassRequest


def test_default_ids_name_the_same_tensors():
    for L in (24, 28, 30, 32, 36):
        a = default_aux_layer_ids(L, "input_to")
        b = default_aux_layer_ids(L, "output_of")
        assert a == [2, L // 2, L - 3] and b == [1, L // 2 - 1, L - 4]
        assert [to_hf_hidden_index(i, "input_to") for i in a] == [to_hf_hidden_index(i, "output_of") for i in b]
        assert [to_convention(i, "output_of", "input_to") for i in b] == a


def _check_aux_against_hf(target, ids, convention):
    target.layer_convention = LayerConvention(convention)
    target.aux_layer_ids = ids
    x = torch.randint(0, 2000, (2, 17), generator=torch.Generator().manual_seed(1))
    out = target.forward(x, request=PassRequest(aux=True))
    ref = target.model(x, output_hidden_states=True)
    d = target.geometry.hidden_size
    for j, i in enumerate(ids):
        want = ref.hidden_states[to_hf_hidden_index(i, convention)]
        # Fused q|k|v and gate|up matmuls round differently from HF's separate ones: ~3e-5 after 30 layers.
        # A wrong layer index differs by O(1), so this tolerance still pins the convention down.
        torch.testing.assert_close(out.aux_hidden[..., j * d:(j + 1) * d], want, rtol=1e-4, atol=1e-4)
        neighbour = ref.hidden_states[to_hf_hidden_index(i, convention) + 1]  # off by one: must not match
        assert (out.aux_hidden[..., j * d:(j + 1) * d] - neighbour).abs().max() > 1e-2
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("convention", ["input_to", "output_of"])
def test_aux_hidden_matches_hf_tiny(convention):
    t = load_target("tiny_random")
    # output_of L-1 is deliberately not HF's last entry (that one is post-norm): see the next test.
    ids = [0, 0] if convention == "output_of" else [0, 1]
    _check_aux_against_hf(t, ids, convention)


def test_last_layer_output_is_pre_norm():
    t = load_target("tiny_random", aux_layer_ids=[1])
    x = torch.randint(0, 2000, (1, 9))
    out = t.forward(x, request=PassRequest(aux=True))
    ref = t.model(x, output_hidden_states=True)
    torch.testing.assert_close(t.model.model.norm(out.aux_hidden), ref.hidden_states[-1], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["input_to", "output_of"])
def test_aux_hidden_matches_hf_smollm2(smollm2, convention):
    ids = default_aux_layer_ids(smollm2.geometry.num_layers, convention)
    saved = smollm2.layer_convention, smollm2.aux_layer_ids
    try:
        _check_aux_against_hf(smollm2, ids, convention)
    finally:
        smollm2.layer_convention, smollm2.aux_layer_ids = saved


def test_cached_forward_equals_full_forward(tiny_target):
    x = torch.randint(0, 5000, (1, 20), generator=torch.Generator().manual_seed(2))
    full = tiny_target.forward(x).logits
    cache = tiny_target.new_cache(1, 64)
    a = tiny_target.forward(x[:, :12], cache=cache).logits
    cache.commit(12)
    outs = [a]
    for t in range(12, 20):
        outs.append(tiny_target.forward(x[:, t:t + 1], cache=cache).logits)
        cache.commit(1)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-4)


def test_bad_aux_ids_and_mask_shape(tiny_target):
    with pytest.raises(ValueError, match="out of range"):
        load_target("tiny_random", aux_layer_ids=[0, 5, 1])
    with pytest.raises(ValueError, match="attn_mask"):
        tiny_target.forward(torch.zeros(1, 3, dtype=torch.long), attn_mask=torch.ones(3, 4, dtype=torch.bool))


def test_cache_overflow_is_explicit(tiny_target):
    cache = tiny_target.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="KV cache overflow"):
        tiny_target.forward(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def test_target_protocol_lists_what_callers_use(tiny_target):
    from draftlab.targets import Target

    used = ["geometry", "tokenizer", "name", "layer_convention", "aux_layer_ids", "eos_token_ids", "device", "dtype",
            "model", "chat_template", "new_cache", "forward", "forward_with_grad", "embed", "lm_head", "final_norm",
            "forward_layers", "check_layer_ids"]
    declared = set(Target.__annotations__) | {n for n in vars(Target) if not n.startswith("_")}
    assert [n for n in used if n not in declared] == []
    assert isinstance(tiny_target, Target)


def test_embed_norm_head_are_the_forward_pieces(tiny_target):
    x = torch.randint(0, 5000, (2, 7), generator=torch.Generator().manual_seed(6))  # [B, T]
    out = tiny_target.forward(x, request=PassRequest(last_hidden=True))
    h = tiny_target.forward_layers(tiny_target.embed(x), 0, tiny_target.geometry.num_layers).hidden  # [B, T, d]
    with torch.no_grad():
        assert torch.equal(tiny_target.final_norm(h), out.last_hidden)
        assert torch.equal(tiny_target.lm_head(h), out.logits)
        assert torch.equal(tiny_target.lm_head(out.last_hidden, norm=False), out.logits)
        one = tiny_target.lm_head(h[:1, -1:])  # [1, 1, V]: the single-row transposed head
    torch.testing.assert_close(one, out.logits[:1, -1:], rtol=0, atol=1e-5)
