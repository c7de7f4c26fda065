"""The loss menu (draftlab.training.losses): each term and D-PACE against hand-computed values and gradients,
the chunked path against plain autograd, and its memory: only the inputs are saved for backward."""

from __future__ import annotations

import math

import pytest
import torch

from draftlab.training.losses import NAMES, Loss, dpace_weights, position_losses

# One position, V = 3: target p, draft q = softmax(z) with z = log q, label y = 0.
P = [0.5, 0.3, 0.2]
Q = [0.2, 0.5, 0.3]
M = [(a + b) / 2 for a, b in zip(P, Q)]
ALPHA = sum(min(a, b) for a, b in zip(P, Q))  # 0.7
KL = sum(a * math.log(a / b) for a, b in zip(P, Q))
RKL = sum(b * math.log(b / a) for a, b in zip(P, Q))
JSD = 0.5 * sum(a * math.log(a / m) for a, m in zip(P, M)) + 0.5 * sum(b * math.log(b / m) for b, m in zip(Q, M))
TV = 0.5 * sum(abs(a - b) for a, b in zip(P, Q))  # 0.3
LAM = math.exp(-3.0 * ALPHA)


def _through_softmax(g):
    """d/dz of a function of q = softmax(z) whose gradient in q is g: q * (g - sum q g)."""
    s = sum(q * x for q, x in zip(Q, g))
    return [q * (x - s) for q, x in zip(Q, g)]


G_KL = [q - p for p, q in zip(P, Q)]
G_RKL = [q * (math.log(q / p) - RKL) for p, q in zip(P, Q)]
G_JSD = _through_softmax([0.5 * math.log(q / m) for q, m in zip(Q, M)])
G_TV = _through_softmax([0.5 * math.copysign(1.0, q - p) for p, q in zip(P, Q)])
G_CE = [Q[0] - 1.0, Q[1], Q[2]]
G_NLA = [g / ALPHA for g in G_TV]
G_LK = [LAM * a + (1 - LAM) * b for a, b in zip(G_KL, G_TV)]

HAND = {"kl": (KL, G_KL), "rkl": (RKL, G_RKL), "jsd": (JSD, G_JSD), "tv": (TV, G_TV),
        "ce": (-math.log(Q[0]), G_CE), "nla": (-math.log(ALPHA), G_NLA), "lk": (LAM * KL + (1 - LAM) * TV, G_LK)}


def _value_and_grad(loss: Loss, **kw):
    z = torch.tensor([Q], dtype=torch.float64).log().requires_grad_(True)
    p = torch.tensor([P], dtype=torch.float64)
    val = position_losses(loss, z, p, torch.tensor([0]), **kw)
    val.sum().backward()
    return val.item(), z.grad[0].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_each_term_matches_its_hand_computed_value_and_gradient(name):
    value, grad = _value_and_grad(Loss(terms={name: 1.0}))
    want, want_grad = HAND[name]
    assert value == pytest.approx(want, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)


def test_a_weighted_mix_is_the_weighted_sum_of_its_terms():
    value, grad = _value_and_grad(Loss(terms={"ce": 0.1, "tv": 0.9}))
    assert value == pytest.approx(0.1 * HAND["ce"][0] + 0.9 * TV, abs=1e-12)
    assert grad == pytest.approx([0.1 * a + 0.9 * b for a, b in zip(G_CE, G_TV)], abs=1e-12)


def test_tv_has_no_gradient_where_the_draft_equals_the_target():
    z = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(z.detach(), -1)
    val = position_losses(Loss(terms={"tv": 1.0}), z, p)
    val.sum().backward()
    assert val.abs().max().item() < 1e-15
    assert z.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_the_chunked_path_equals_plain_autograd(name):
    """Row chunks of one row each (forward and the recomputing backward) against autograd through ``row_loss``."""
    torch.manual_seed(0)
    loss = Loss(terms={name: 1.0})
    z = torch.randn(7, 13, dtype=torch.float64)
    p = torch.softmax(torch.randn(7, 13, dtype=torch.float64) * 2, -1)
    y = torch.randint(0, 13, (7,))
    g = torch.rand(7, dtype=torch.float64)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (position_losses(loss, z1, p, y, chunk_elements=13) * g).sum().backward()
    (loss.row_loss(z2, p, y) * g).sum().backward()
    assert torch.allclose(z1.grad, z2.grad, atol=1e-12)
    if name == "lk":  # its blend weight is detached by design: its gradient is not its value's derivative
        return
    assert torch.autograd.gradcheck(lambda t: position_losses(loss, t, p, y, chunk_elements=26),
                                    (z.clone().requires_grad_(True),))


def test_only_the_inputs_are_saved_for_backward():
    """The memory-lean path: whatever the loss, autograd keeps the logits, the teacher and the labels, no
    fp32 [N, V] temporary (plain autograd through the LK mix saves several)."""
    z = torch.randn(64, 500, requires_grad=True)
    p = torch.softmax(torch.randn(64, 500), -1)
    y = torch.randint(0, 500, (64,))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    loss = Loss(terms={"lk": 0.5, "jsd": 0.25, "ce": 0.25})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        position_losses(loss, z, p, y).sum()
    inputs = sum(t.numel() * t.element_size() for t in (z, p, y))
    assert sum(saved) <= inputs
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss.row_loss(z, p, y).sum()
    assert sum(saved) > 3 * inputs  # the same mix through plain autograd: what the chunked path avoids


def test_dpace_weights_by_hand():
    conf = torch.tensor([[0.8, 0.5, 0.2]])
    # s = (1 - 0.5) c + 0.5 = [0.9, 0.75, 0.6]; prefix products [0.9, 0.675, 0.405]; suffix sums of them.
    assert dpace_weights(conf, torch.ones(1, 3, dtype=torch.bool), 0.5).tolist()[0] == pytest.approx([1.98, 1.08, 0.405])
    # A masked last slot: s = 1 there, it adds nothing and weighs 0.
    masked = dpace_weights(conf, torch.tensor([[True, True, False]]), 0.5).tolist()[0]
    assert masked == pytest.approx([1.575, 0.675, 0.0])
    # alpha = 1: every smoothed confidence is 1, so position k weighs the number of valid positions from k on.
    assert dpace_weights(conf, torch.ones(1, 3, dtype=torch.bool), 1.0).tolist()[0] == pytest.approx([3.0, 2.0, 1.0])


def test_dpace_weights_carry_no_gradient():
    conf = torch.tensor([[0.8, 0.5]], requires_grad=True)
    assert not dpace_weights(conf, torch.ones(1, 2, dtype=torch.bool)).requires_grad


@pytest.mark.parametrize(("cfg", "match"), [({"terms": {}}, "empty"), ({"terms": {"kld": 1.0}}, "unknown loss term"),
                                            ({"terms": {"kl": -1.0}}, "finite weight"),
                                            ({"weighting": "decay"}, "weighting must be one of")])
def test_bad_settings_are_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        Loss.of(cfg)


def test_a_soft_term_without_the_teacher_is_refused():
    with pytest.raises(ValueError, match="need the target's distribution"):
        position_losses(Loss(terms={"tv": 1.0}), torch.zeros(2, 3), None, torch.zeros(2, dtype=torch.long))
