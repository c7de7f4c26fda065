"""``Target.forward_layers``: layer ranges compose to ``forward``; per-layer cache lengths; rollback."""

import pytest
import torch

from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets.base import PassRequest
from draftlab.targets.tiny import tiny_random_target

ATOL = 1e-5


@pytest.fixture(scope="module")
def deep():
    # Four layers, so three non-trivial ranges [0, a) + [a, b) + [b, L) exist (tiny_random has two).
    return tiny_random_target(num_layers=4)


def _tree(n=9, seed=1, vocab=5000):
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 5])[:n]
    tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))  # [N]
    return DraftTree.from_parents(tokens, parents)


def _composed(target, ids, cuts, **kw):
    """embed -> forward_layers over consecutive ranges split at ``cuts`` -> lm_head; returns (logits, aux)."""
    bounds = [0, *cuts, target.geometry.num_layers]
    h = target.embed(ids)  # [B, T, d]
    aux = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        taps = [i for i in target.aux_layer_ids if a <= i < b]
        out = target.forward_layers(h, a, b, aux_layer_ids=taps, **kw)
        h = out.hidden  # [B, T, d]
        if taps:
            aux.append(out.aux)
    # Inference (drafters run under the engine's no_grad) takes the same CPU fast paths as ``forward``; under
    # grad mode the head runs as plain F.linear, which rounds differently (~3e-5 on SmolLM2 logits).
    with torch.no_grad():
        return target.lm_head(h), torch.cat(aux, -1)  # [B, T, V], [B, T, n_aux * d]


@pytest.mark.parametrize("cuts", [(1, 3), (2, 2), (0, 4)])
def test_layer_ranges_compose_to_forward(deep, cuts):
    """Prefill, a single-token decode step and tree rows: composed ranges equal ``forward`` and its cache."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5000, (1, 23), generator=g)  # [1, P]
    ref_cache, cache = deep.new_cache(1, 64), deep.new_cache(1, 64)

    ref = deep.forward(ids, cache=ref_cache, request=PassRequest(aux=True))
    got, aux = _composed(deep, ids, cuts, cache=cache)
    torch.testing.assert_close(got, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, ref.aux_hidden, rtol=0, atol=ATOL)
    ref_cache.commit(ids.shape[1])
    cache.commit(ids.shape[1])

    step = torch.tensor([[4242]])  # [1, 1]
    ref = deep.forward(step, cache=ref_cache, request=PassRequest(aux=True))
    got, aux = _composed(deep, step, cuts, cache=cache)
    torch.testing.assert_close(got, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, ref.aux_hidden, rtol=0, atol=ATOL)
    ref_cache.commit(1)
    cache.commit(1)

    tree = _tree()
    past = cache.length
    mask = torch.cat([torch.ones(tree.size, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)  # [N, past + N]
    pos = past + tree.depth  # [N]
    ref = deep.forward(tree.tokens[None], pos, ref_cache, mask, request=PassRequest(aux=True))
    got, aux = _composed(deep, tree.tokens[None], cuts, cache=cache, position_ids=pos, attn_mask=mask)
    torch.testing.assert_close(got, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, ref.aux_hidden, rtol=0, atol=ATOL)
    # Each range wrote the K/V of its own layers only, so together they wrote what the full pass wrote.
    end = past + tree.size
    torch.testing.assert_close(cache.k[:, :, :, :end], ref_cache.k[:, :, :, :end], rtol=0, atol=ATOL)
    torch.testing.assert_close(cache.v[:, :, :, :end], ref_cache.v[:, :, :, :end], rtol=0, atol=ATOL)


def test_forward_layers_writes_only_its_layers(deep):
    cache = deep.new_cache(1, 16)
    h = deep.embed(torch.tensor([[5, 6, 7]]))  # [1, 3, d]
    deep.forward_layers(h, 1, 3, cache=cache)
    written = cache.k[:, 0, :, :3].abs().sum(dim=(1, 2, 3))  # [L]
    assert written[0] == 0 and written[3] == 0 and written[1] > 0 and written[2] > 0


def test_tokens_at_different_depths(deep):
    """A self-drafter runs two tokens through layers [0, a) at explicit slots, later catches up on [a, L)."""
    L, a = deep.geometry.num_layers, 2
    ids = torch.randint(0, 5000, (1, 15), generator=torch.Generator().manual_seed(3))  # [1, P]
    nxt = torch.tensor([[311, 977]])  # [1, 2]
    P = ids.shape[1]
    ref_cache, cache = deep.new_cache(1, 32), deep.new_cache(1, 32)
    ref = deep.forward(torch.cat([ids, nxt], 1), cache=ref_cache).logits[:, P:]  # [1, 2, V]
    ref_cache.commit(P + 2)
    deep.forward(ids, cache=cache)
    cache.commit(P)

    shallow = []
    for j in range(2):
        # Slot P + j: past the committed length and past the previous step, which must survive.
        out = deep.forward_layers(deep.embed(nxt[:, j:j + 1]), 0, a, cache=cache, slots=[P + j])
        cache.commit_layers(1, range(a))
        shallow.append(out.hidden)  # [1, 1, d]
        assert [cache.layer_length(i) for i in range(L)] == [P + j + 1] * a + [P] * (L - a)
        assert cache.length == P and cache.ragged
    # The first step's K at layer 0 survived the second step's write.
    torch.testing.assert_close(cache.k[0, :, :, P], ref_cache.k[0, :, :, P], rtol=0, atol=ATOL)

    # Deep layers for both tokens at once; at those layers only [0, P) is committed, so the default mask
    # is committed + the two rows, causally.
    out = deep.forward_layers(torch.cat(shallow, 1), a, L, cache=cache, slots=[P, P + 1])
    cache.commit_layers(2, range(a, L))
    assert cache.length == P + 2 and not cache.ragged
    with torch.no_grad():
        torch.testing.assert_close(deep.lm_head(out.hidden), ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(cache.k[:, :, :, :P + 2], ref_cache.k[:, :, :, :P + 2], rtol=0, atol=ATOL)

    # And decoding continues as if the tokens had gone through the full forward.
    step = torch.tensor([[12]])
    torch.testing.assert_close(deep.forward(step, cache=cache).logits, deep.forward(step, cache=ref_cache).logits,
                               rtol=0, atol=ATOL)


def test_rollback_equals_a_cache_that_never_saw_the_rows(deep):
    L, a = deep.geometry.num_layers, 3
    ids = torch.randint(0, 5000, (1, 11), generator=torch.Generator().manual_seed(4))  # [1, P]
    P = ids.shape[1]
    clean, cache = deep.new_cache(1, 32), deep.new_cache(1, 32)
    for c in (clean, cache):
        deep.forward(ids, cache=c)
        c.commit(P)

    # Three provisional draft steps through layers [0, a), then all rejected.
    for j, tok in enumerate((901, 902, 903)):
        deep.forward_layers(deep.embed(torch.tensor([[tok]])), 0, a, cache=cache, slots=[P + j])
        cache.commit_layers(1, range(a))
    assert cache.layer_length(0) == P + 3 and cache.length == P
    cache.truncate(P, layers=range(a))
    assert [cache.layer_length(i) for i in range(L)] == [P] * L and not cache.ragged

    # The next token overwrites slot P in every layer; slots P+1, P+2 of layers [0, a) still hold the
    # rejected rows, which nothing may read now.
    step = torch.tensor([[77]])
    outs = []
    for c in (clean, cache):
        outs.append(deep.forward(step, cache=c).logits)  # [1, 1, V]
        c.commit(1)
    assert torch.equal(outs[0], outs[1])
    got = deep.forward(torch.tensor([[78, 79]]), cache=cache).logits  # [1, 2, V]
    want = deep.forward(torch.tensor([[78, 79]]), cache=clean).logits
    assert torch.equal(got, want)
    assert cache.length == clean.length
    n = clean.length + 2
    assert torch.equal(cache.k[:, :, :, :n], clean.k[:, :, :, :n]) and torch.equal(cache.v[:, :, :, :n], clean.v[:, :, :, :n])


def test_forward_layers_argument_errors(deep):
    h = deep.embed(torch.tensor([[1, 2]]))  # [1, 2, d]
    cache = deep.new_cache(1, 8)
    with pytest.raises(ValueError, match="layer range"):
        deep.forward_layers(h, 2, 5, cache=cache)
    with pytest.raises(ValueError, match="not computed"):
        deep.forward_layers(h, 0, 1, cache=cache, aux_layer_ids=[2])
    with pytest.raises(ValueError, match="slots"):
        deep.forward_layers(h, 0, 1, slots=[0, 1])  # slots without a cache
    with pytest.raises(ValueError, match="distinct"):
        deep.forward_layers(h, 0, 1, cache=cache, slots=[3, 3])
    with pytest.raises(RuntimeError, match="overflow"):
        deep.forward_layers(h, 0, 1, cache=cache, slots=[7, 8])
    with pytest.raises(ValueError, match="attn_mask"):
        deep.forward_layers(h, 0, 1, cache=cache, slots=[4, 6], attn_mask=torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.slow
def test_layer_ranges_and_full_view_on_smollm2(smollm2):
    from draftlab.targets.cache import SparseView

    t = smollm2
    L = t.geometry.num_layers
    ids = torch.tensor([t.tokenizer("The quick brown fox jumps over the lazy dog. " * 2)["input_ids"]])  # [1, P]
    P = ids.shape[1]
    ref_cache, cache = t.new_cache(1, P + 32), t.new_cache(1, P + 32)
    cuts = (L // 3, 2 * L // 3)
    ref = t.forward(ids, cache=ref_cache, request=PassRequest(aux=True))
    got, aux = _composed(t, ids, cuts, cache=cache)
    torch.testing.assert_close(got, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, ref.aux_hidden, rtol=0, atol=ATOL)
    ref_cache.commit(P)
    cache.commit(P)

    step = torch.tensor([[504]])
    ref = t.forward(step, cache=ref_cache).logits  # [1, 1, V]
    got, _ = _composed(t, step, cuts, cache=cache)
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
    # Same step through a sparse view that lists every committed slot: dense attention.
    view = SparseView.full(range(L), t.geometry.num_kv_heads, P)
    with torch.no_grad():
        sparse = t.lm_head(t.forward_layers(t.embed(step), 0, L, cache=cache, view=view).hidden)  # [1, 1, V]
    torch.testing.assert_close(sparse, ref, rtol=0, atol=ATOL)
    ref_cache.commit(1)
    cache.commit(1)

    tree = _tree(vocab=20000)
    past = cache.length
    mask = torch.cat([torch.ones(tree.size, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)  # [N, past + N]
    ref = t.forward(tree.tokens[None], past + tree.depth, ref_cache, mask).logits  # [1, N, V]
    got, _ = _composed(t, tree.tokens[None], cuts, cache=cache, position_ids=past + tree.depth, attn_mask=mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
