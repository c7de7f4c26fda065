"""KVCache per-layer lengths and rollback, and sparse read views (``SparseView``) against dense attention."""

import pytest
import torch

from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets.cache import KVCache, SparseView

ATOL = 1e-5


# ---- the cache on its own -----------------------------------------------------------------------------


def test_per_layer_lengths_and_truncate():
    c = KVCache(3, 1, 2, 4, 16)
    c.commit(5)
    assert c.length == 5 and [c.layer_length(i) for i in range(3)] == [5, 5, 5] and not c.ragged
    c.commit_layers(2, range(2))
    assert c.length == 5 and [c.layer_length(i) for i in range(3)] == [7, 7, 5] and c.ragged
    c.commit_layers(1, [2])
    assert c.length == 6  # the common length is the shallowest layer's
    c.truncate(6, layers=[0])
    assert [c.layer_length(i) for i in range(3)] == [6, 7, 6]
    with pytest.raises(ValueError, match="cannot truncate layer 2"):
        c.truncate(7, layers=[2])
    with pytest.raises(ValueError, match="cannot truncate"):
        c.truncate(7)  # beyond the common length
    c.truncate(4)
    assert [c.layer_length(i) for i in range(3)] == [4, 4, 4] and c.length == 4 and not c.ragged
    with pytest.raises(RuntimeError, match="overflow"):
        c.commit_layers(13, [0])
    with pytest.raises(ValueError, match="out of range"):
        c.commit_layers(1, [3])


def test_commit_drops_provisional_rows_and_length_setter():
    c = KVCache(2, 1, 1, 4, 16)
    c.commit_layers(3, [0])
    assert c.ragged
    # A commit follows a pass over every layer, which overwrote the scratch slots of every layer.
    c.commit(1)
    assert [c.layer_length(i) for i in range(2)] == [1, 1] and not c.ragged
    c.commit_layers(2, [1])
    c.commit_rows([1, 0])
    assert [c.layer_length(i) for i in range(2)] == [3, 3]
    c.length = 2  # as a grown cache is set after copying rows over
    assert [c.layer_length(i) for i in range(2)] == [2, 2]
    c.reset()
    assert c.length == 0 and c.layer_length(1) == 0


def test_write_at_explicit_slots():
    c = KVCache(2, 1, 2, 3, 8)
    k = torch.arange(2 * 2 * 3, dtype=torch.float32).view(1, 2, 2, 3)  # [B, H, T, hd]
    c.write_at(1, torch.tensor([5, 2]), k, -k)
    assert torch.equal(c.k[1, :, :, 5], k[:, :, 0]) and torch.equal(c.k[1, :, :, 2], k[:, :, 1])
    assert torch.equal(c.v[1, :, :, 2], -k[:, :, 1])
    assert c.k[0].abs().sum() == 0 and c.length == 0  # other layers and lengths untouched


def test_gather_and_mask():
    kv = torch.randn(2, 2, 6, 3)  # [B, Hkv, S, hd]
    idx = torch.tensor([[0, 4, 4], [5, 1, 2]])  # [Hkv, K]; head 0 pads by repeating slot 4
    got = SparseView.gather(idx, kv)  # [B, Hkv, K, hd]
    assert torch.equal(got[:, 0], kv[:, 0, [0, 4, 4]]) and torch.equal(got[:, 1], kv[:, 1, [5, 1, 2]])
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)  # [1, 1, T, S]
    mask[0, 0, 0, 1] = False
    own = torch.zeros(6, dtype=torch.bool)
    own[5] = True  # slot 5 is a row of the pass: read once, from the rows themselves
    m = SparseView.gather_mask(idx, mask, own)  # [1, Hkv, T, K]
    assert m[0, 0].tolist() == [[True, True, False], [True, True, False]]  # the repeat is masked out
    assert m[0, 1].tolist() == [[False, False, True], [False, True, True]]


# ---- views in the target's attention --------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefilled(tiny_target):
    """tiny_target with a committed 30-token context; returns (target, a fresh copy of the cache per call)."""
    ids = torch.randint(0, 5000, (1, 30), generator=torch.Generator().manual_seed(5))  # [1, P]
    cache = tiny_target.new_cache(1, 64)
    tiny_target.forward(ids, cache=cache)
    cache.commit(ids.shape[1])

    def copy():
        c = tiny_target.new_cache(1, 64)
        c.k.copy_(cache.k)
        c.v.copy_(cache.v)
        c.length = cache.length
        return c

    return tiny_target, copy


def _tree_rows(past, seed=2):
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, 4])
    tree = DraftTree.from_parents(torch.randint(0, 5000, (7,), generator=torch.Generator().manual_seed(seed)), parents)
    mask = torch.cat([torch.ones(tree.size, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)  # [N, past + N]
    return tree.tokens[None], past + tree.depth, mask


def _run(t, cache, ids, pos=None, mask=None, view=None):
    h = t.forward_layers(t.embed(ids), 0, t.geometry.num_layers, position_ids=pos, cache=cache, attn_mask=mask,
                         view=view).hidden  # [1, T, d]
    with torch.no_grad():  # the engine's grad mode, so the head takes forward's kernels
        return t.lm_head(h)  # [1, T, V]


def _shuffled_full_view(t, P, seed=0):
    # Every committed slot, in a different order per head, plus padding repeats: still dense attention.
    g = torch.Generator().manual_seed(seed)
    Hkv = t.geometry.num_kv_heads
    idx = torch.stack([torch.cat([torch.randperm(P, generator=g), torch.tensor([3, 3])]) for _ in range(Hkv)])
    return SparseView({layer: idx for layer in range(t.geometry.num_layers)})  # [Hkv, P + 2] per layer


@pytest.mark.parametrize("rows", ["decode", "tree"])
def test_full_view_equals_dense(prefilled, rows):
    t, copy = prefilled
    P = copy().length
    ids, pos, mask = (torch.tensor([[123]]), None, None) if rows == "decode" else _tree_rows(P)
    dense = t.forward(ids, pos, copy(), mask).logits  # [1, T, V]
    for view in (SparseView.full(range(t.geometry.num_layers), t.geometry.num_kv_heads, P),
                 _shuffled_full_view(t, P)):
        torch.testing.assert_close(_run(t, copy(), ids, pos, mask, view), dense, rtol=0, atol=ATOL)
    # Listing the rows' own scratch slots as well changes nothing (they are read once).
    T = ids.shape[1]
    own = SparseView.full(range(t.geometry.num_layers), t.geometry.num_kv_heads, P + T)
    torch.testing.assert_close(_run(t, copy(), ids, pos, mask, own), dense, rtol=0, atol=ATOL)


def test_strict_subset_differs_and_matches_the_masked_dense_pass(prefilled):
    t, copy = prefilled
    P = copy().length
    Hkv, L = t.geometry.num_kv_heads, t.geometry.num_layers
    ids, pos, mask = _tree_rows(P)
    dense = t.forward(ids, pos, copy(), mask).logits  # [1, N, V]

    # The same subset for every head and layer is expressible as a dense mask: the two must agree.
    keep = torch.tensor([0, 1, 2, 7, 11, 20, 28, 29])  # [K]
    view = SparseView({layer: keep.expand(Hkv, -1) for layer in range(L)})
    sparse = _run(t, copy(), ids, pos, mask, view)
    assert (sparse - dense).abs().max() > 1e-3  # dropping context changes the output
    masked = mask.clone()
    drop = torch.ones(P, dtype=torch.bool)
    drop[keep] = False
    masked[:, :P][:, drop] = False
    torch.testing.assert_close(sparse, t.forward(ids, pos, copy(), masked).logits, rtol=0, atol=ATOL)

    # Per-head subsets: head 1 reads other slots than head 0, so the output differs from the shared subset.
    other = torch.stack([keep, torch.tensor([3, 4, 5, 6, 8, 9, 10, 12])])  # [Hkv, K]
    per_head = _run(t, copy(), ids, pos, mask, SparseView({layer: other for layer in range(L)}))
    assert (per_head - sparse).abs().max() > 1e-3

    # A view on one layer only: the other layer reads densely, so it lies between the two.
    one = _run(t, copy(), ids, pos, mask, SparseView({0: keep.expand(Hkv, -1)}))
    assert (one - dense).abs().max() > 1e-3 and (one - sparse).abs().max() > 1e-3


def test_view_respects_the_mask_and_the_cache(prefilled):
    t, copy = prefilled
    P = copy().length
    full = SparseView.full(range(t.geometry.num_layers), t.geometry.num_kv_heads, P)
    # A mask that hides the first 10 context slots hides them from the view too.
    ids = torch.tensor([[321]])
    mask = torch.ones(1, P + 1, dtype=torch.bool)
    mask[0, :10] = False
    torch.testing.assert_close(_run(t, copy(), ids, None, mask, full), t.forward(ids, None, copy(), mask).logits,
                               rtol=0, atol=ATOL)
    # The view pass writes the rows' K/V like the dense one (a sparse drafter's rows can be committed).
    a, b = copy(), copy()
    _run(t, a, ids, view=full)
    t.forward(ids, cache=b)
    torch.testing.assert_close(a.k[:, :, :, :P + 1], b.k[:, :, :, :P + 1], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="beyond"):
        _run(t, copy(), ids, view=SparseView({0: torch.full((t.geometry.num_kv_heads, 1), P + 5)}))


# ---- a view compacted into a cache of its own (SparseSpec-L's draft steps) -----------------------------------


def _steps_over(t, cache, tokens, first_pos):
    """Decode ``tokens`` one at a time over ``cache`` at true positions; logits [len, V]."""
    out = []
    for i, tok in enumerate(tokens):
        logits = t.forward(torch.tensor([[tok]]), torch.tensor([first_pos + i]), cache).logits[0, -1]
        cache.commit(1)
        out.append(logits)
    return torch.stack(out)


def test_compacted_full_view_equals_dense_decoding(prefilled):
    t, copy = prefilled
    P = copy().length
    L, Hkv = t.geometry.num_layers, t.geometry.num_kv_heads
    dense = _steps_over(t, copy(), [11, 12, 13], P)  # [3, V]
    g = torch.Generator().manual_seed(1)
    shuffled = SparseView({li: torch.stack([torch.randperm(P, generator=g) for _ in range(Hkv)]) for li in range(L)})
    for view in (SparseView.full(range(L), Hkv, P), shuffled):  # slot order within a head does not matter
        small = view.compact(copy(), scratch_rows=4)
        assert small.length == P and small.max_length == P + 4
        torch.testing.assert_close(_steps_over(t, small, [11, 12, 13], P), dense, rtol=0, atol=ATOL)


def test_compacted_subset_equals_the_in_place_view(prefilled):
    t, copy = prefilled
    P = copy().length
    L = t.geometry.num_layers
    per_head = torch.stack([torch.tensor([0, 1, 2, 7, 11, 20, 28, 29]), torch.tensor([3, 4, 5, 6, 8, 9, 10, 12])])
    view = SparseView({li: per_head for li in range(L)})
    in_place = _run(t, copy(), torch.tensor([[77]]), torch.tensor([P]), None, view)[0, -1]  # [V]
    reused = KVCache(L, 1, t.geometry.num_kv_heads, t.geometry.head_dim, 32)
    small = view.compact(copy(), scratch_rows=2, out=reused)
    assert small is reused and small.length == 8  # a large enough cache is reused, not reallocated
    torch.testing.assert_close(_steps_over(t, small, [77], P)[0], in_place, rtol=0, atol=ATOL)
    assert (in_place - _steps_over(t, copy(), [77], P)[0]).abs().max() > 1e-3  # and it is not dense


def test_compact_rejects_what_dense_attention_would_get_wrong(prefilled):
    t, copy = prefilled
    L, Hkv = t.geometry.num_layers, t.geometry.num_kv_heads
    with pytest.raises(ValueError, match="distinct"):
        SparseView({li: torch.tensor([[0, 1, 1]] * Hkv) for li in range(L)}).compact(copy(), 2)
    with pytest.raises(ValueError, match="every layer"):
        SparseView({0: torch.tensor([[0, 1]] * Hkv)}).compact(copy(), 2)
    with pytest.raises(ValueError, match="committed context"):
        SparseView({li: torch.tensor([[0, 99]] * Hkv) for li in range(L)}).compact(copy(), 2)
