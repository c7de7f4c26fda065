import math

import pytest
import torch

from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.eagle3 import (
    CausalAttention,
    Eagle3Config,
    Eagle3Draft,
    TTTAttention,
    naive_ttt_attention,
    simulated_tau,
    ttt_attention,
    ttt_attention_mask,
    ttt_forward,
)
from draftlab.methods.eagle3.ttt import _shift_left
from draftlab.targets.base import PassRequest

D, DT, V, VD = 32, 16, 50, 20



def small_draft(dtype=torch.float64, seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=D, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=V,
                       draft_vocab_size=VD, target_hidden_size=DT)
    draft = Eagle3Draft(cfg).to(dtype)
    # A draft vocabulary that is not simply the first V_d ids.
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:VD]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(VD))
    return draft


def batch(B=3, T=10, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * DT, generator=g, dtype=dtype)
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=dtype)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 7:] = 0  # right padding
    attn[2, 4:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :2] = 0  # a "prompt"
    return ids, aux, logits, loss_mask, attn


def test_mask_pattern():
    m = ttt_attention_mask(3, 3, torch.tensor([[1, 1, 0]]))[0].int()
    want = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0, 0, 1, 0],
                         [1, 1, 0, 0, 0, 1, 0, 0, 1]])
    assert torch.equal(m, want)


def test_step0_equals_plain_causal_forward():
    draft = small_draft()
    ids, aux, logits, loss_mask, attn = batch()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    ids0 = _shift_left(ids, 1)
    h_ttt, l_ttt = draft.forward_step(ids0, aux, pos, TTTAttention(attn))
    h_ref, l_ref = draft.forward_step(ids0, aux, pos, CausalAttention(attn))
    torch.testing.assert_close(h_ttt, h_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(l_ttt, l_ref, rtol=0, atol=1e-12)

    # ... and the one-step TTT loss is the soft cross-entropy of that forward against target_logits[t+1].
    out = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=1)
    z = _shift_left(logits, 1)[..., draft.target_ids()]
    p = torch.softmax(z, -1)
    in_draft = draft.t2d[_shift_left(logits, 1).argmax(-1)] & _shift_left(attn, 1).bool()
    ce = -(p * torch.log_softmax(l_ref, -1)).sum(-1)
    want = (ce * in_draft * loss_mask).sum() / ids.numel()
    torch.testing.assert_close(out.loss, want)


def test_ttt_attention_matches_naive_values_and_grads():
    g = torch.Generator().manual_seed(0)
    B, H, HKV, T, HD, K = 2, 4, 2, 7, 8, 3
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 5:] = 0
    q = torch.randn(B, H, T, HD, generator=g, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(B, HKV, T, HD, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(K)]
    values = [torch.randn(B, HKV, T, HD, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(K)]
    for k in range(1, K + 1):
        fast = ttt_attention(q, keys[:k], values[:k], attn, HD ** -0.5)
        slow = naive_ttt_attention(q, keys[:k], values[:k], attn, HD ** -0.5)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
        w = torch.randn(fast.shape, generator=g, dtype=torch.float64)
        leaves = [q, *keys[:k], *values[:k]]
        g_fast = torch.autograd.grad((fast * w).sum(), leaves)
        g_slow = torch.autograd.grad((slow * w).sum(), leaves)
        for a, b in zip(g_fast, g_slow):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ttt_attention_over_query_rows_equals_those_rows_of_the_full_unroll():
    # On-policy replay unrolls only the rows a round started from: their outputs must be the full unroll's.
    g = torch.Generator().manual_seed(1)
    B, H, HKV, T, HD, K = 2, 4, 2, 9, 8, 3
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 7:] = 0
    rows = torch.tensor([0, 3, 6])
    q = torch.randn(B, H, T, HD, generator=g, dtype=torch.float64)
    keys = [torch.randn(B, HKV, T, HD, generator=g, dtype=torch.float64) for _ in range(K)]
    values = [torch.randn(B, HKV, T, HD, generator=g, dtype=torch.float64) for _ in range(K)]
    for k in range(2, K + 1):
        full = ttt_attention(q, keys[:k], values[:k], attn, HD ** -0.5)
        sub = ttt_attention(q[:, :, rows], keys[:1] + [x[:, :, rows] for x in keys[1:k]],
                            values[:1] + [x[:, :, rows] for x in values[1:k]], attn, HD ** -0.5, query_rows=rows)
        torch.testing.assert_close(sub, full[:, :, rows], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["torch", "blockwise", "auto"])
def test_ttt_forward_efficient_matches_naive_values_and_grads(impl):
    ids, aux, logits, loss_mask, attn = batch()
    results = []
    for name in (impl, "naive"):
        draft = small_draft()
        x = aux.clone().requires_grad_(True)
        out = ttt_forward(draft, ids, x, logits, loss_mask, attn, ttt_length=3, impl=name)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
        results.append((out, grads, x.grad.clone()))
    (fast, g_fast, x_fast), (slow, g_slow, x_slow) = results
    torch.testing.assert_close(fast.loss, slow.loss, rtol=1e-10, atol=0)
    for a, b in zip(fast.per_step, slow.per_step):
        for key in a:
            torch.testing.assert_close(a[key].double(), b[key].double(), rtol=1e-10, atol=1e-12)
    assert g_fast.keys() == g_slow.keys() and "fc.weight" in g_fast
    for name in g_fast:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(x_fast, x_slow, rtol=1e-9, atol=1e-12)
    assert x_fast.abs().sum() > 0


def test_later_steps_see_own_states_and_shifted_positions():
    ids, aux, logits, loss_mask, attn = batch()
    draft = small_draft()
    calls = []
    original = draft.forward_step

    def spy(input_ids, hidden, position_ids, attention):
        calls.append((input_ids, hidden.shape[-1], position_ids))
        return original(input_ids, hidden, position_ids, attention)

    draft.forward_step = spy
    ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=3)
    for k, (step_ids, width, pos) in enumerate(calls):
        assert torch.equal(step_ids, _shift_left(ids, k + 1))  # ground-truth tokens, shifted per step
        assert width == (3 * DT if k == 0 else D)  # target features first, the draft's own state after
        assert torch.equal(pos, torch.arange(10).expand(3, 10) + k)


class TableDraft:
    """Stub draft whose logits depend only on the consumed token, so every number below is known."""

    def __init__(self, q_table, t2d):
        self.logq = torch.log(torch.tensor(q_table, dtype=torch.float64))  # [V, V_d]
        self.t2d = t2d
        self.d2t = t2d.nonzero().flatten() - torch.arange(int(t2d.sum()))
        self.positions = []

    def forward_step(self, input_ids, hidden, position_ids, attention):
        self.positions.append(position_ids)
        return hidden, self.logq[input_ids]


def test_loss_and_metrics_hand_checked():
    # V=8, draft vocabulary {1, 3, 4, 6} (draft ids 0..3).
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 3, 4, 6]] = True
    p_full = [
        [0.125] * 8,
        [0.10, 0.20, 0.05, 0.40, 0.10, 0.05, 0.05, 0.05],  # argmax 3 (draft id 1)
        [0.05, 0.10, 0.05, 0.10, 0.05, 0.50, 0.10, 0.05],  # argmax 5: outside the draft vocab -> masked
        [0.05, 0.05, 0.05, 0.10, 0.05, 0.05, 0.60, 0.05],  # argmax 6 (draft id 3)
        [0.05, 0.10, 0.05, 0.05, 0.60, 0.05, 0.05, 0.05],  # argmax 4 (draft id 2)
    ]
    q = [[0.25] * 4] * 8
    q[1] = [0.1, 0.7, 0.1, 0.1]  # after token 1 the draft predicts draft id 1 (token 3)
    q[2] = [0.4, 0.2, 0.2, 0.2]  # -> token 1
    q[3] = [0.1, 0.1, 0.1, 0.7]  # -> token 6
    q[4] = [0.1, 0.1, 0.6, 0.2]  # -> token 4
    draft = TableDraft(q, t2d)
    ids = torch.tensor([[0, 1, 2, 3, 4]])
    logits = torch.log(torch.tensor([p_full], dtype=torch.float64))
    loss_mask = torch.tensor([[1, 1, 1, 1, 0]])
    aux = torch.zeros(1, 5, 3)
    out = ttt_forward(draft, ids, aux, logits, loss_mask, ttt_length=2, step_weight=0.5)
    assert [p.tolist() for p in draft.positions] == [[[0, 1, 2, 3, 4]], [[1, 2, 3, 4, 5]]]

    S = [1, 3, 4, 6]

    def ce(target_row, consumed):
        mass = sum(p_full[target_row][s] for s in S)
        return -sum(p_full[target_row][s] / mass * math.log(q[consumed][i]) for i, s in enumerate(S))

    # Step 0: row t consumes x_{t+1} = t+1, targets row t+1, weight loss_mask[t]; row 4 has no target.
    # Row 1 (target argmax 5) is masked from the loss and counts as a miss.
    s0 = out.per_step[0]
    torch.testing.assert_close(s0["loss"].double(), torch.tensor((ce(1, 1) + ce(3, 3) + ce(4, 4)) / 5, dtype=torch.float64))
    assert float(s0["count"]) == 4 and float(s0["correct"]) == 3 and float(s0["acc"]) == 0.75
    assert float(s0["cond_acc"]) == 0.75
    # Acceptance (full softmax mass on draft tokens vs q), row 0: min(.2,.1)+min(.4,.7)+min(.1,.1)+min(.05,.1).
    acc_rows = [0.1 + 0.4 + 0.1 + 0.05,
                0.10 + 0.10 + 0.05 + 0.10,  # row 1 (q after token 2)
                0.05 + 0.10 + 0.05 + 0.60,  # row 2 (q after token 3)
                0.10 + 0.05 + 0.60 + 0.05]  # row 3 (q after token 4)
    assert float(s0["acceptance_rate"]) == pytest.approx(sum(acc_rows) / 4)

    # Step 1: row t consumes x_{t+2}, targets row t+2, weight loss_mask[t+1] -> rows 0..2.
    # Row 0 (target argmax 5) misses; rows 1, 2 hit. Among rows correct at step 0 (0, 2): only row 2.
    s1 = out.per_step[1]
    torch.testing.assert_close(s1["loss"].double(), torch.tensor((ce(3, 3) + ce(4, 4)) / 5, dtype=torch.float64))
    assert float(s1["count"]) == 3 and float(s1["acc"]) == pytest.approx(2 / 3)
    assert float(s1["cond_count"]) == 2 and float(s1["cond_acc"]) == 0.5
    torch.testing.assert_close(out.loss, s0["loss"] + 0.5 * s1["loss"])

    masked = ttt_forward(draft, ids, aux, logits, loss_mask, ttt_length=2, normalization="mask_sum")
    torch.testing.assert_close(masked.per_step[0]["loss"].double(),
                               torch.tensor((ce(1, 1) + ce(3, 3) + ce(4, 4)) / 4, dtype=torch.float64))
    torch.testing.assert_close(masked.per_step[1]["loss"].double(),
                               torch.tensor((ce(3, 3) + ce(4, 4)) / 3, dtype=torch.float64))
    # Row 4 has no target row at step 0 and is never counted, even with loss_mask 1 there.
    full = ttt_forward(draft, ids, aux, logits, torch.ones(1, 5), ttt_length=2)
    assert [float(s["count"]) for s in full.per_step] == [4, 3]
    with pytest.raises(ValueError, match="normalization"):
        ttt_forward(draft, ids, aux, logits, loss_mask, normalization="tokens")


def test_simulated_tau():
    assert simulated_tau([0.5, 0.5]) == 1.75  # 1 (bonus) + 0.5 + 0.25
    assert simulated_tau([0.5, 0.5], include_bonus=False) == 0.75  # SpecForge's simulated_acc_len
    assert simulated_tau([]) == 1.0


def test_end_to_end_tiny_target_training_reduces_loss(tiny_target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3000, (2, 24), generator=g)
    attn = torch.ones(2, 24, dtype=torch.long)
    attn[1, 18:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    out = tiny_target.forward(ids, request=PassRequest(aux=True))
    aux, logits = out.aux_hidden, out.logits  # [2, 24, 192], [2, 24, 49152]
    # Draft vocabulary from the target's own greedy tokens, as with regenerated training data.
    freq = torch.bincount(logits.argmax(-1).flatten(), minlength=logits.shape[-1])
    draft = Eagle3Draft.from_target(tiny_target, vocab_mapping=build_vocab_mapping(freq, 128))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(15):
        res = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=3)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    assert draft.embed_tokens.weight.grad is None
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses  # the soft-target entropy is a floor, so not ~0
    assert res.metric("acc")[0] > 0.5


def _teacher_reference(draft, z: torch.Tensor):
    """The teacher as it was computed whole: full-vocabulary fp32 (or wider) tensors ``[B, T, V]``."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    ids = draft.d2t + torch.arange(draft.d2t.numel())
    z_d = z.index_select(-1, ids)
    return (torch.exp(z_d - torch.logsumexp(z_d, -1, keepdim=True)), torch.exp(z_d - torch.logsumexp(z, -1, keepdim=True)),
            draft.t2d[z.argmax(-1)].float(), z_d.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk_rows", [1, 7, None])
def test_compact_teacher_equals_the_whole_one(dtype, chunk_rows):
    """The chunked teacher (no [B, T, V] fp32 tensor) gives the whole one's targets, masks and argmax."""
    from draftlab.methods.eagle3.ttt import _TargetSide

    draft = small_draft(torch.float32)
    _, _, logits, _, _ = batch(dtype=torch.float64)
    logits = logits.to(dtype)
    got = _TargetSide.of(draft, logits, chunk_rows=chunk_rows)
    p, p_full, in_draft, argmax = _teacher_reference(draft, logits)
    torch.testing.assert_close(got.p, p, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.p_full, p_full, rtol=0, atol=1e-6)
    assert torch.equal(got.in_draft, in_draft) and torch.equal(got.argmax, argmax)


def test_compact_teacher_trains_like_the_whole_one(monkeypatch):
    """Loss, metrics and gradients of a TTT step are the same whether the teacher is built in 1-row chunks or
    whole (fp32, <= 1e-6)."""
    from draftlab.methods.eagle3.ttt import _TargetSide

    ids, aux, logits, loss_mask, attn = batch(dtype=torch.float32)
    results = []
    for elements in (1, 1 << 30):  # one row per chunk / every row in one chunk
        monkeypatch.setattr(_TargetSide, "CHUNK_ELEMENTS", elements)
        draft = small_draft(torch.float32)
        out = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=3)
        out.loss.backward()
        results.append((out, {n: q.grad.clone() for n, q in draft.named_parameters() if q.requires_grad}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=1e-6)
    for sa, sb in zip(a.per_step, b.per_step):
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=1e-6)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=1e-6, msg=name)


def test_training_on_cpu_runs_the_blockwise_attention_and_chunked_loss_by_default(monkeypatch):
    """``attention: auto`` and ``cross_entropy: auto`` (conf/method/eagle3.yaml) are the blockwise attention and
    the chunked soft cross-entropy on CPU: the conformance suite's pinned losses are trained through them."""
    from draftlab.kernels import soft_cross_entropy as ce_kernel
    from draftlab.kernels import ttt_attention as kernel
    from draftlab.methods.eagle3.ttt_training import TTTStep

    calls, losses = [], []
    original, original_ce = kernel._Blockwise.apply, ce_kernel._ChunkedSoftCE.apply
    monkeypatch.setattr(kernel._Blockwise, "apply", lambda *a: calls.append(a[0].shape) or original(*a))
    monkeypatch.setattr(ce_kernel._ChunkedSoftCE, "apply", lambda *a: losses.append(1) or original_ce(*a))
    ids, aux, logits, loss_mask, attn = batch()
    step = TTTStep(ttt_length=3)
    assert step.attention == "auto" and step.cross_entropy == "auto"
    draft = small_draft().float()
    step(draft, ids, aux.float(), logits.float(), loss_mask, attn).loss.backward()
    assert len(calls) == 3 and len(losses) == 3  # one per TTT step (the small draft has one layer)
