"""The DFlash draft and its training blocks: shapes, defaults, the block mask, isolation and loss weights."""

from __future__ import annotations

import math

import pytest
import torch

from draftlab.methods.dflash import build_draft, default_gamma, default_taps
from draftlab.methods.dflash.blocks import (
    block_attention_mask,
    block_logits,
    block_loss,
    context_mask,
    eligible_anchors,
    make_blocks,
    sample_anchors,
)
from draftlab.methods.dflash.config import position_weights
from draftlab.methods.dflash.model import block_attention
from draftlab.methods.eagle3.model import masked_attention
from draftlab.targets.base import PassRequest

BS = 4


@pytest.fixture(scope="module")
def draft(tiny_target):
    return build_draft(tiny_target, num_layers=2, block_size=BS, seed=0)


def _batch(target, draft, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 5000, (2, T), generator=g)  # [B, T]
    loss_mask = torch.ones(2, T, dtype=torch.long)
    loss_mask[:, :5] = 0
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, T - 4:] = 0  # right padding
    loss_mask[1, T - 4:] = 0
    return ids, loss_mask, attn


def _aux(target, draft, ids):
    return target.forward(ids, request=PassRequest(aux=draft.taps(target), logits_rows=torch.arange(0))).aux_hidden  # [B, T, n_taps*d]


def test_default_taps_follow_dflash():
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as the released checkpoints
    smol = default_taps(30, 5)
    assert smol[0] == 1 and smol[-1] == 27 and smol == sorted(smol) and len(set(smol)) == 5
    assert all(0 <= i < 2 for i in default_taps(2, 5))  # shallow test targets stay in range
    assert default_gamma(16) == 7 and default_gamma(8) == 4 and default_gamma(10) == 5


def test_shapes_and_state_dict(tiny_target, draft):
    c, g = draft.config, tiny_target.geometry
    assert c.num_taps == 5 and c.hidden_size == g.hidden_size and c.vocab_size == g.vocab_size
    assert draft.fc.weight.shape == (g.hidden_size, 5 * g.hidden_size)
    keys = set(draft.state_dict())
    # The target's embedding and LM head are shared, not owned: never saved, never trained.
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert all(p.requires_grad for p in draft.parameters())
    assert draft.embed_weight.data_ptr() == tiny_target.model.get_input_embeddings().weight.data_ptr()
    ids, lm, attn = _batch(tiny_target, draft)
    blocks = make_blocks(ids, lm, attn, block_size=BS, mask_token_id=c.mask_token_id, num_anchors=5)
    logits = block_logits(draft, _aux(tiny_target, draft, ids), blocks)
    assert logits.shape == (2, blocks.anchors.shape[1], BS - 1, g.vocab_size)
    assert torch.isfinite(logits).all()


def test_anchors_come_from_loss_masked_positions():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0]])
    attn = torch.ones_like(lm)
    elig = eligible_anchors(lm, attn)
    assert elig[0].nonzero().flatten().tolist() == [2, 3, 6]  # needs a loss-masked successor
    assert not elig[1].any()
    anchors, keep = sample_anchors(lm, attn, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)
    assert anchors[0].tolist() == [2, 3, 6] and keep[0].all() and not keep[1].any()
    a1, _ = sample_anchors(lm, attn, 2, torch.Generator().manual_seed(1))
    assert set(a1[0].tolist()) <= {2, 3, 6} and len(set(a1[0].tolist())) == 2


def test_training_mask_is_the_dflash_rule():
    anchors = torch.tensor([[3, 6]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    mask = block_attention_mask(anchors, attn, 3)  # [1, 6, 10 + 6]
    T = 10
    for row in range(6):
        j = row // 3
        a = anchors[0, j].item()
        # context strictly before the anchor
        assert mask[0, row, :T].nonzero().flatten().tolist() == list(range(a))
        # bidirectional inside the block, nothing of the other block
        assert mask[0, row, T:].nonzero().flatten().tolist() == list(range(3 * j, 3 * j + 3))
    assert torch.equal(context_mask(anchors, attn, 3), mask[..., :T])


def test_block_attention_equals_explicit_mask():
    torch.manual_seed(0)
    B, H, Hkv, hd, T, A, bs = 2, 4, 2, 8, 9, 3, 4
    q = torch.randn(B, H, A * bs, hd, dtype=torch.float64)
    k_ctx, v_ctx = torch.randn(B, Hkv, T, hd, dtype=torch.float64), torch.randn(B, Hkv, T, hd, dtype=torch.float64)
    k_blk = torch.randn(B, Hkv, A * bs, hd, dtype=torch.float64)
    v_blk = torch.randn(B, Hkv, A * bs, hd, dtype=torch.float64)
    anchors = torch.tensor([[0, 4, 8], [2, 3, 7]])  # anchor 0: no context at all
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 6:] = 0
    fast = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, context_mask(anchors, attn, bs), bs, 0.3)
    ref = masked_attention(q, torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2),
                           block_attention_mask(anchors, attn, bs), 0.3)
    assert torch.allclose(fast, ref, atol=1e-12)


def test_tokens_after_the_anchor_context_do_not_change_the_block(tiny_target, draft):
    ids, lm, attn = _batch(tiny_target, draft, T=24)
    anchors = torch.tensor([[9, 14], [9, 12]])
    c = draft.config

    def logits_of(x):
        blocks = make_blocks(x, lm, attn, block_size=BS, mask_token_id=c.mask_token_id, anchors=anchors)
        return block_logits(draft, _aux(tiny_target, draft, x), blocks)  # [B, A, BS-1, V]

    base = logits_of(ids)
    later = ids.clone()
    later[:, 10:] = torch.randint(100, 5000, later[:, 10:].shape)  # everything after anchor 9
    out = logits_of(later)
    assert torch.allclose(out[:, 0], base[:, 0], atol=1e-6)  # block at 9: context 0..8 + its anchor token
    assert not torch.allclose(out[:, 1], base[:, 1], atol=1e-3)  # block at 14/12 sees the change
    earlier = ids.clone()
    earlier[:, 8] = (earlier[:, 8] + 7) % 5000  # last context token of the block at 9: the test can fail
    assert not torch.allclose(logits_of(earlier)[:, 0], base[:, 0], atol=1e-3)


def test_blocks_are_isolated(tiny_target, draft):
    ids, lm, attn = _batch(tiny_target, draft)
    aux = _aux(tiny_target, draft, ids)
    c = draft.config
    packed = make_blocks(ids, lm, attn, block_size=BS, mask_token_id=c.mask_token_id,
                         anchors=torch.tensor([[6, 7, 11], [5, 8, 10]]))
    together = block_logits(draft, aux, packed)
    for j in range(3):
        alone = make_blocks(ids, lm, attn, block_size=BS, mask_token_id=c.mask_token_id,
                            anchors=packed.anchors[:, j:j + 1])
        assert torch.allclose(block_logits(draft, aux, alone)[:, 0], together[:, j], atol=1e-5)


def test_loss_weights_and_normalisation():
    assert position_weights(4, 2.0) == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])
    V = 5
    labels = torch.tensor([[[1, 2, 3]]])  # one block, 3 slots
    from draftlab.methods.dflash.blocks import Blocks

    blocks = Blocks(anchors=torch.zeros(1, 1, dtype=torch.long), keep=torch.ones(1, 1, dtype=torch.bool),
                    block_ids=torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(4)[None],
                    labels=labels, label_valid=torch.tensor([[[True, True, False]]]),
                    ctx_mask=torch.zeros(1, 4, 0, dtype=torch.bool))
    logits = torch.randn(1, 1, 3, V)
    out = block_loss(logits, blocks, gamma=2.0)
    ce = torch.nn.functional.cross_entropy(logits[0, 0], labels[0, 0], reduction="none")
    w = torch.tensor([1.0, math.exp(-0.5)])
    assert torch.allclose(out.loss, (ce[:2] * w).sum() / w.sum())  # the invalid slot counts nowhere
    assert out.per_slot["count"].tolist() == [1, 1, 0]
