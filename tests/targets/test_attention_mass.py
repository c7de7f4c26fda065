"""``Target.forward`` with ``PassRequest(attn_mass_rows=W)``: the per-slot attention mass of the last W rows, against HF eager
``output_attentions`` (the reference a sparse-KV drafter's importance scores must match)."""

import pytest
import torch

from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets import hf as hf_target
from draftlab.targets.base import PassRequest
from draftlab.targets.tiny import tiny_random_target

ATOL = 1e-5


@pytest.fixture(scope="module")
def target():
    t = tiny_random_target(num_layers=3, num_heads=4, num_kv_heads=2)
    t.model.config._attn_implementation = "eager"  # HF returns attention probabilities only in eager mode
    return t


def _hf_mass(target, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """[L, 1, Hkv, S] from HF: probabilities of the last ``rows`` rows, summed over rows and each group."""
    g = target.geometry
    with torch.no_grad():
        att = target.model(ids, output_attentions=True).attentions  # L x [1, H, T, S]
    G = g.num_heads // g.num_kv_heads
    return torch.stack([a[:, :, -rows:].reshape(1, g.num_kv_heads, G, rows, -1).sum((2, 3)) for a in att])


@pytest.mark.parametrize("length, rows", [(20, 5), (200, 16), (200, 200)])
def test_prefill_mass_matches_hf_eager(target, length, rows):
    # 200 rows take the fused-SDPA path of a long prefill, which scores the W rows a second time.
    ids = torch.randint(0, 5000, (1, length), generator=torch.Generator().manual_seed(length))
    cache = target.new_cache(1, length + 4)
    out = target.forward(ids, cache=cache, request=PassRequest(attn_mass_rows=rows))
    g = target.geometry
    assert out.attn_mass.shape == (g.num_layers, 1, g.num_kv_heads, length)
    # Sums of up to 200 probabilities: relative rounding of fp32 sums.
    torch.testing.assert_close(out.attn_mass, _hf_mass(target, ids, rows), atol=ATOL, rtol=1e-5)
    # Each row's probabilities sum to one over the slots, for each of the H query heads.
    torch.testing.assert_close(out.attn_mass.sum(-1), torch.full_like(out.attn_mass.sum(-1), rows * g.num_heads
                                                                       / g.num_kv_heads), atol=1e-4, rtol=0)


def test_both_attention_paths_give_the_same_mass(target, monkeypatch):
    ids = torch.randint(0, 5000, (1, 40), generator=torch.Generator().manual_seed(3))
    small = target.forward(ids, cache=target.new_cache(1, 44), request=PassRequest(attn_mass_rows=7)).attn_mass
    monkeypatch.setattr(hf_target, "_GROUPED_ATTENTION_MAX_ROWS", 0)  # force fused SDPA + the re-scored rows
    fused = target.forward(ids, cache=target.new_cache(1, 44), request=PassRequest(attn_mass_rows=7)).attn_mass
    torch.testing.assert_close(fused, small, atol=ATOL, rtol=0)


def test_verify_pass_mass_over_a_chain_equals_the_full_sequence(target):
    # A chain verify pass after a prefill is the same computation as the last rows of one long forward.
    ids = torch.randint(0, 5000, (1, 30), generator=torch.Generator().manual_seed(4))
    cache = target.new_cache(1, 40)
    target.forward(ids[:, :25], cache=cache)
    cache.commit(25)
    chain = DraftTree.chain(int(ids[0, 25]), ids[0, 26:].tolist())
    mask = torch.cat([torch.ones(5, 25, dtype=torch.bool), ancestor_mask(chain.parents)], 1)  # [5, 30]
    out = target.forward(ids[:, 25:], 25 + chain.depth, cache, mask, request=PassRequest(attn_mass_rows=5))
    torch.testing.assert_close(out.attn_mass, _hf_mass(target, ids, 5), atol=ATOL, rtol=0)


def test_no_mass_unless_asked(target):
    ids = torch.randint(0, 5000, (1, 6))
    assert target.forward(ids).attn_mass is None
    with pytest.raises(ValueError, match="attn_mass_rows"):
        target.forward(ids, request=PassRequest(attn_mass_rows=-1))
