"""Pinned rows (``PinnedKV``): keys computed once and read by later passes equal having those rows in the pass."""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.tree import ancestor_mask
from draftlab.targets.base import PassRequest
from draftlab.targets.cache import PinnedKV


def _pinned(target, embeds):
    # P rows that see only each other (causally), at positions 0..P-1: a pass of their own, captured.
    P = embeds.shape[0]
    cache = target.new_cache(1, P)
    target.forward(None, torch.arange(P), cache, request=PassRequest(input_embeds=embeds[None], logits_rows=torch.arange(0)))
    cache.commit(P)
    return PinnedKV.capture(cache)


def _prefix_cache(target, ids, extra_rows):
    cache = target.new_cache(1, len(ids) + extra_rows)
    target.forward(torch.tensor([ids]), cache=cache)
    cache.commit(len(ids))
    return cache


@pytest.mark.parametrize("kernel", ["grouped", "sdpa"])
def test_pinned_rows_equal_rows_in_the_pass(tiny_target, kernel, monkeypatch):
    """A tree + rows that see the tree and P side rows: the side rows run in the pass (as extra rows that
    do not see the prefix) or are pinned, computed once: same logits and aux states at every other row."""
    import draftlab.targets.hf as hf

    if kernel == "sdpa":
        monkeypatch.setattr(hf, "_GROUPED_ATTENTION_MAX_ROWS", 0)
    torch.manual_seed(0)
    t = tiny_target
    d, V = t.geometry.hidden_size, t.geometry.vocab_size
    P, n = 5, 6
    side = torch.randn(P, d) * 0.5  # [P, d]
    prefix = torch.randint(V, (11,)).tolist()
    parents = torch.tensor([-1, 0, 0, 1, 1, 3])
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    tokens = torch.randint(V, (n,))
    past = len(prefix)
    # Rows: n tree rows, then n "probe" rows (probe i sees node i's ancestors, itself and every side row).
    anc = ancestor_mask(parents)  # [n, n]
    probe_pos = past + depth + 1

    # (a) side rows inside the pass: [tree | side | probes], side rows see only each other.
    cache = _prefix_cache(t, prefix, n + P + n)
    R = n + P + n
    mask = torch.zeros(R, past + R, dtype=torch.bool)
    mask[:n, :past] = True
    mask[:n, past:past + n] = anc
    mask[n:n + P, past + n:past + n + P] = torch.ones(P, P, dtype=torch.bool).tril()
    mask[n + P:, :past] = True
    mask[n + P:, past:past + n] = anc
    mask[n + P:, past + n:past + n + P] = True
    mask[n + P:, past + n + P:] = torch.eye(n, dtype=torch.bool)
    embeds = torch.cat([t.embed(tokens[None])[0], side, side[:1].expand(n, -1) * 0.3])
    pos = torch.cat([past + depth, torch.arange(P), probe_pos])
    full = t.forward(None, pos, cache, mask, request=PassRequest(aux=True, input_embeds=embeds[None]))

    # (b) side rows pinned: [tree | probes] + pinned keys for the probes only.
    cache_b = _prefix_cache(t, prefix, 2 * n)
    pinned = _pinned(t, side)
    R2 = 2 * n
    mask_b = torch.zeros(R2, past + R2, dtype=torch.bool)
    mask_b[:, :past] = True
    mask_b[:n, past:past + n] = anc
    mask_b[n:, past:past + n] = anc
    mask_b[n:, past + n:] = torch.eye(n, dtype=torch.bool)
    pmask = torch.cat([torch.zeros(n, P, dtype=torch.bool), torch.ones(n, P, dtype=torch.bool)])
    embeds_b = torch.cat([embeds[:n], embeds[n + P:]])
    pos_b = torch.cat([past + depth, probe_pos])
    part = t.forward(None, pos_b, cache_b, mask_b, request=PassRequest(aux=True, input_embeds=embeds_b[None], pinned=pinned, pinned_mask=pmask))

    keep = torch.cat([torch.arange(n), torch.arange(n + P, R)])
    torch.testing.assert_close(part.logits[0], full.logits[0, keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(part.aux_hidden[0], full.aux_hidden[0, keep], rtol=1e-5, atol=1e-5)  # states ~10
    # Tree rows' keys in the cache are those of a pass without any side rows.
    torch.testing.assert_close(cache_b.k[:, :, :, past:past + n], cache.k[:, :, :, past:past + n], rtol=0, atol=1e-5)
    # A probe that may not see the side rows is a different row: the mask is honoured.
    pmask_off = pmask.clone()
    pmask_off[-1] = False
    off = t.forward(None, pos_b, _prefix_cache(t, prefix, 2 * n), mask_b, request=PassRequest(input_embeds=embeds_b[None], pinned=pinned, pinned_mask=pmask_off))
    assert (off.logits[0, -1] - part.logits[0, -1]).abs().max() > 1e-3
    torch.testing.assert_close(off.logits[0, :-1], part.logits[0, :-1], rtol=0, atol=1e-5)


def test_pinned_argument_errors(tiny_target):
    t = tiny_target
    pinned = _pinned(t, torch.randn(3, t.geometry.hidden_size))
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="pinned_mask must be"):
        t.forward(ids, request=PassRequest(pinned=pinned, pinned_mask=torch.ones(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="without pinned keys"):
        t.forward(ids, request=PassRequest(pinned_mask=torch.ones(2, 3, dtype=torch.bool)))
    bad = PinnedKV(pinned.k[:1], pinned.v[:1])
    with pytest.raises(ValueError, match="do not fit"):
        t.forward(ids, request=PassRequest(pinned=bad))
