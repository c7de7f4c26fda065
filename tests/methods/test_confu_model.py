"""ConFu draft pieces: MoE gating, future-key attention, visibility rule, EAGLE-3 init, the grad target pass."""

from __future__ import annotations

import pytest
import torch

from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.confu import (
    ConFuConfig,
    ConFuDraft,
    EmbeddingMoE,
    FutureTTTAttention,
    build_confu_draft,
    future_ttt_attention,
    future_visibility,
    naive_future_ttt_attention,
)
from draftlab.methods.eagle3 import Eagle3Draft, ttt_forward
from draftlab.methods.eagle3.export.native import save_native
from draftlab.targets.base import PassRequest

VD = 128


def _eagle3(target, **kw) -> Eagle3Draft:
    torch.manual_seed(0)
    mapping = build_vocab_mapping(torch.ones(target.geometry.vocab_size), VD)
    return Eagle3Draft.from_target(target, vocab_mapping=mapping, **kw)


# ---- MoE -------------------------------------------------------------------------------------------------


def test_moe_is_renormalised_top_k_of_a_linear_router():
    torch.manual_seed(0)
    moe = EmbeddingMoE(12, 5, n_experts=6, top_k=2)
    moe.reset_parameters(torch.zeros(5), torch.ones(5))
    x = torch.randn(3, 4, 12)
    w, ids = moe.gates(x)  # [3, 4, 2]
    probs = torch.softmax(moe.router(torch.nn.functional.rms_norm(x, (12,))), -1)
    top, want_ids = probs.topk(2, -1)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, top / top.sum(-1, keepdim=True), atol=1e-6)
    want = (w[..., None] * moe.experts[ids]).sum(-2)
    assert torch.allclose(moe(x), want, atol=1e-6)
    assert not torch.allclose(moe(x)[0, 0], moe(x)[0, 1])  # the embedding depends on the input
    moe(x).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.grad.abs().sum() > 0


def test_moe_off_is_one_learned_embedding():
    moe = EmbeddingMoE(12, 5, n_experts=6, top_k=2, enabled=False)
    moe.reset_parameters(torch.zeros(5), torch.ones(5))
    assert moe.router is None and moe.experts.shape == (1, 5)
    out = moe(torch.randn(7, 12))
    assert torch.equal(out, moe.experts[0].expand(7, 5))


# ---- future keys -----------------------------------------------------------------------------------------


def test_future_visibility_follows_the_latest_earlier_anchor_within_the_window():
    anchors = torch.tensor([[2, 5, -1], [0, -1, -1]])
    vis = future_visibility(anchors, 9, window=2)  # [2, 9, 3]
    sees = [[int(r.nonzero()[0]) if r.any() else None for r in vis[b]] for b in range(2)]
    assert sees[0] == [None, None, 0, 0, None, 1, 1, None, None]
    assert sees[1] == [0, 0, None, None, None, None, None, None, None]
    assert (vis.sum(-1) <= 1).all()
    # Never a future anchored after the row.
    rows = torch.arange(9)[None, :, None]
    assert not (vis & (anchors[:, None, :] > rows)).any()
    assert future_visibility(anchors, 9, window=1).sum() == 3  # replication off: anchor rows only


@pytest.mark.parametrize("steps", [1, 3])
def test_future_ttt_attention_equals_the_brute_force_reference(steps):
    torch.manual_seed(0)
    B, H, Hkv, T, K, hd = 2, 4, 2, 7, 3, 8
    q = torch.randn(B, H, T, hd)
    keys = [torch.randn(B, Hkv, T, hd) for _ in range(steps)]
    values = [torch.randn(B, Hkv, T, hd) for _ in range(steps)]
    fk, fv = torch.randn(B, Hkv, K, hd), torch.randn(B, Hkv, K, hd)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, 5:] = False
    fmask = future_visibility(torch.tensor([[1, 4, -1], [0, 2, -1]]), T, window=2)
    assert not fmask.any(-1).all()  # some rows see no future at all
    fast = future_ttt_attention(q, keys, values, pad, fk, fv, fmask, 0.3)
    ref = naive_future_ttt_attention(q, keys, values, pad, fk, fv, fmask, 0.3)
    assert torch.allclose(fast, ref, atol=1e-5)
    # The future really enters the rows that see it, and only those.
    moved = future_ttt_attention(q, keys, values, pad, fk, fv + 1.0, fmask, 0.3)
    seen = fmask.any(-1)  # [B, T]
    diff = (moved - fast).abs().amax(dim=(1, 3))  # [B, T]
    assert (diff[seen] > 1e-3).all() and (diff[~seen] == 0).all()


def test_confu_without_visible_futures_is_eagle3(tiny_target):
    """With every future masked out, the ConFu TTT is the EAGLE-3 TTT of the copied weights."""
    base = _eagle3(tiny_target)
    draft = ConFuDraft.from_eagle3(base)
    torch.manual_seed(1)
    B, T = 2, 10
    ids = torch.randint(0, 500, (B, T))
    aux = torch.randn(B, T, 3 * tiny_target.geometry.hidden_size)
    logits = torch.randn(B, T, tiny_target.geometry.vocab_size)
    logits[..., base.target_ids()] += 5.0  # the teacher's argmax lies in the draft vocabulary
    loss_mask = torch.ones(B, T)
    anchors = torch.tensor([[3, 6], [2, 8]])
    e_f = draft.future_embedding(aux[:, :2])
    fkv = draft.future_kv(e_f, torch.randn(B, 2, draft.config.hidden_size), anchors)
    none = torch.zeros(B, T, 2, dtype=torch.bool)
    want = ttt_forward(base, ids, aux, logits, loss_mask, ttt_length=3)
    got = ttt_forward(draft, ids, aux, logits, loss_mask, ttt_length=3,
                      attention=FutureTTTAttention(None, fkv, none))
    assert want.loss > 0 and torch.allclose(got.loss, want.loss, atol=1e-5)
    seen = ttt_forward(draft, ids, aux, logits, loss_mask, ttt_length=3,
                       attention=FutureTTTAttention(None, fkv, future_visibility(anchors, T, 2)))
    assert not torch.allclose(seen.loss, want.loss, atol=1e-3)


def test_future_kv_is_the_self_attending_row_of_the_draft_layers(tiny_target):
    """The captured keys/values are those the draft's own layers give a row that sees only itself."""
    draft = ConFuDraft.from_eagle3(_eagle3(tiny_target, num_layers=2))
    from draftlab.methods.eagle3.model import CacheAttention

    e_f, f = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    kv = draft.future_kv(e_f, f, torch.tensor([[5]]))
    cache = draft.new_cache(1, 4)
    draft.forward_embeds(e_f, f, torch.tensor([[5]]), CacheAttention(cache, torch.ones(1, 1, dtype=torch.bool)))
    assert len(kv) == 2
    for layer, (k, v) in enumerate(kv):
        assert torch.allclose(k, cache.k[layer, :, :, :1], atol=1e-6)
        assert torch.allclose(v, cache.v[layer, :, :, :1], atol=1e-6)


# ---- construction ----------------------------------------------------------------------------------------


def test_from_eagle3_copies_weights_and_initialises_the_rest(tiny_target, tmp_path):
    base = _eagle3(tiny_target)
    draft = ConFuDraft.from_eagle3(base, num_soft_prompts=4, n_experts=3, moe=False, separate_fc_f=True)
    assert isinstance(draft.config, ConFuConfig) and draft.config.num_soft_prompts == 4
    for k, v in base.state_dict().items():
        assert torch.equal(draft.state_dict()[k], v), k
    assert draft.soft_prompts.shape == (4, 64) and draft.soft_prompts.abs().sum() > 0
    assert draft.con_moe.router is None and torch.equal(draft.fc_f.weight, base.fc.weight)
    names = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert {"soft_prompts", "con_moe.experts", "f_moe.experts", "fc_f.weight"} <= names
    assert "embed_tokens.weight" not in names
    # The config block of conf/method/confu.yaml, from an export of the EAGLE-3 draft.
    save_native(base, tmp_path / "e3", verifier=tiny_target)
    built = build_confu_draft(tiny_target, init_from=str(tmp_path / "e3"), num_layers=1, n_experts=5)
    assert built.config.n_experts == 5
    assert torch.equal(built.fc.weight, base.fc.weight) and torch.equal(built.d2t, base.d2t)
    with pytest.raises(ValueError, match="disagrees"):
        build_confu_draft(tiny_target, init_from=str(tmp_path / "e3"), num_layers=2)
    fresh = build_confu_draft(tiny_target, draft_vocab_size=VD, replicate=False)
    assert fresh.config.future_window == 1


def test_registry_builder_continues_a_confu_artifact_or_starts_from_eagle3(tiny_target, tmp_path):
    """``method.draft.init.from`` (on-policy training): a ConFu artifact continues as it is, a configured field
    that disagrees raises, and an EAGLE-3 export starts a ConFu draft as ``init_from`` does."""
    from draftlab.methods.confu.artifact import build_draft, save_confu

    base = _eagle3(tiny_target)
    draft = ConFuDraft.from_eagle3(base, num_soft_prompts=4, n_experts=3)
    save_confu(draft, tmp_path / "confu")
    continued = build_draft(target=tiny_target, init={"from": str(tmp_path / "confu")}, num_layers=1,
                            num_soft_prompts=4, init_from=str(tmp_path / "confu"))
    for k, v in draft.state_dict().items():
        assert torch.equal(continued.state_dict()[k], v), k
    with pytest.raises(ValueError, match=r"init.from=.*num_soft_prompts"):
        build_draft(target=tiny_target, init={"from": str(tmp_path / "confu")}, num_soft_prompts=8)
    save_native(base, tmp_path / "e3", verifier=tiny_target)
    started = build_draft(target=tiny_target, init={"from": str(tmp_path / "e3")}, num_layers=1, n_experts=5)
    assert started.config.n_experts == 5 and torch.equal(started.fc.weight, base.fc.weight)


@pytest.mark.parametrize("steps", [2, 3])
def test_future_ttt_attention_over_query_rows_equals_those_rows_of_the_full_step(steps):
    torch.manual_seed(0)
    B, H, Hkv, T, K, hd = 1, 4, 2, 9, 3, 8
    q = torch.randn(B, H, T, hd)
    keys = [torch.randn(B, Hkv, T, hd) for _ in range(steps)]
    values = [torch.randn(B, Hkv, T, hd) for _ in range(steps)]
    fk, fv = torch.randn(B, Hkv, K, hd), torch.randn(B, Hkv, K, hd)
    fmask = future_visibility(torch.tensor([[1, 4, 6]]), T, window=2)
    full = future_ttt_attention(q, keys, values, None, fk, fv, fmask, 0.3)
    rows = torch.tensor([1, 4, 6])
    part = future_ttt_attention(q[:, :, rows], [keys[0]] + [k[:, :, rows] for k in keys[1:]],
                                [values[0]] + [v[:, :, rows] for v in values[1:]], None, fk, fv, fmask, 0.3, rows)
    torch.testing.assert_close(part, full[:, :, rows], atol=1e-6, rtol=1e-6)


# ---- the grad-enabled target pass ------------------------------------------------------------------------


def test_forward_with_grad_matches_forward_and_leaves_the_cache_alone(tiny_target):
    torch.manual_seed(0)
    ids = torch.randint(0, 2000, (2, 9))
    cache = tiny_target.new_cache(2, 20)
    tiny_target.forward(ids, cache=cache)
    cache.commit(9)
    emb = tiny_target.model.get_input_embeddings()(torch.randint(0, 2000, (2, 3)))
    mask = torch.ones(2, 3, 12, dtype=torch.bool)
    mask[:, :, 9:] = torch.ones(3, 3, dtype=torch.bool).tril()
    mask[1, :, 4:9] = False
    pos = torch.tensor([[9, 10, 11], [3, 4, 5]])
    k_before = cache.k.clone()
    ref = tiny_target.forward(None, pos, cache, mask, request=PassRequest(aux=True, input_embeds=emb))
    cache.k.copy_(k_before)
    x = emb.clone().requires_grad_(True)
    got = tiny_target.forward_with_grad(None, pos, cache, mask, request=PassRequest(aux=True, input_embeds=x))
    assert torch.equal(cache.k, k_before) and cache.length == 9  # read only
    assert torch.allclose(got.logits, ref.logits, atol=1e-5)
    assert torch.allclose(got.aux_hidden, ref.aux_hidden, atol=1e-5)
    w = torch.randn_like(ref.aux_hidden)
    (got.aux_hidden * w).sum().backward()
    assert x.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_target.model.parameters())
    # A directional finite difference agrees with the gradient.
    d = torch.randn_like(emb)
    eps = 1e-3
    with torch.no_grad():
        plus = tiny_target.forward_with_grad(None, pos, cache, mask, request=PassRequest(aux=True, input_embeds=emb + eps * d))
        minus = tiny_target.forward_with_grad(None, pos, cache, mask, request=PassRequest(aux=True, input_embeds=emb - eps * d))
    fd = ((plus.aux_hidden - minus.aux_hidden) * w).sum() / (2 * eps)
    assert torch.allclose(fd, (x.grad * d).sum(), rtol=1e-2)
