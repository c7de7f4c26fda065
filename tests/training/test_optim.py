"""MuonAdamW: its Muon steps against torch.optim.Muon and a plain reference written out here, its AdamW steps
against torch.optim.AdamW, the name-based split, and its wiring through ``schedule.configure`` and checkpoints."""

from __future__ import annotations

import io
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from draftlab.training.optim import MuonAdamW, muon_adamw
from draftlab.training.schedule import configure, warmup_cosine

CONF = Path(__file__).resolve().parents[2] / "conf" / "optimizer"
SHAPES = [(6, 4), (4, 6)]  # tall and wide: the transpose and both lr adjustments differ between them


def _grads(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _params(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _run(opt, params, steps, seed=0):
    grads = [_grads(p.shape, steps, seed + i) for i, p in enumerate(params)]
    for t in range(steps):
        for p, g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()


def _reference_muon(w, grads, *, lr, mu, wd, nesterov, ns_steps, adjust_lr_fn):
    """Muon as written on paper, in float64: b = mu b + g, Nesterov g + mu b, quintic Newton–Schulz."""
    w, b = w.double(), torch.zeros_like(w, dtype=torch.float64)
    rows, cols = w.shape
    for g in grads:
        g = g.double()
        b = mu * b + g
        u = g + mu * b if nesterov else b
        x = u.T if rows > cols else u
        x = x / (x.norm() + 1e-7)
        for _ in range(ns_steps):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        o = x.T if rows > cols else x
        scale = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
        w = w * (1 - lr * wd) - lr * scale * o
    return w


MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "ns_steps": 5}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_steps_match_torch_muon(adjust_lr_fn, nesterov):
    ours, theirs = _params(), _params()
    start = [p.detach().clone() for p in ours]
    _run(MuonAdamW([{"params": ours, "use_muon": True}], nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **MUON),
         ours, steps=2)
    _run(torch.optim.Muon(theirs, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **MUON), theirs, steps=2)
    for p, q, p0 in zip(ours, theirs, start):
        assert (p - p0).abs().max() > 1e-3  # it moved: the tolerance below is far finer than the step
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_steps_match_a_plain_reference(adjust_lr_fn, nesterov):
    params = _params()
    start = [p.detach().clone() for p in params]
    _run(MuonAdamW([{"params": params, "use_muon": True}], nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
                   ns_dtype="float32", **MUON), params, steps=2)
    for i, (p, p0) in enumerate(zip(params, start)):
        ref = _reference_muon(p0, _grads(p0.shape, 2, i), lr=0.02, mu=0.95, wd=0.1, nesterov=nesterov, ns_steps=5,
                              adjust_lr_fn=adjust_lr_fn)
        torch.testing.assert_close(p.double(), ref, atol=1e-6, rtol=0)


def test_reference_tolerance_separates_the_variants():
    # The 1e-6 tolerances above must be able to fail: dropping Nesterov or using the other lr scale moves the
    # weights by far more than that.
    w, grads = _params()[0].detach(), _grads(SHAPES[0], 2)
    ref = partial(_reference_muon, w, grads, lr=0.02, mu=0.95, wd=0.1, ns_steps=5)
    base = ref(nesterov=True, adjust_lr_fn="original")
    assert (base - ref(nesterov=False, adjust_lr_fn="original")).abs().max() > 1e-4
    assert (base - ref(nesterov=True, adjust_lr_fn="match_rms_adamw")).abs().max() > 1e-4


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_muon_update_is_orthogonalised(ns_dtype):
    gen = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen))
    q2, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen))
    grad = q1[:, :5] @ torch.diag(torch.linspace(0.5, 2.0, 5)) @ q2.T  # singular values 0.5 .. 2
    p = nn.Parameter(torch.zeros(8, 5))
    p.grad = grad
    MuonAdamW([{"params": [p], "use_muon": True}], lr=0.1, adjust_lr_fn="original", ns_dtype=ns_dtype).step()
    update = -p.detach() / (0.1 * math.sqrt(8 / 5))  # no decay, first step: the update is NS(g) alone
    s = torch.linalg.svdvals(update)
    assert s.min() > 0.68 and s.max() < 1.13, s


def test_adamw_groups_match_torch_adamw():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (1, 4)]
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = muon_adamw([(f"draft.lm_head.{i}", p) for i, p in enumerate(ours)], **kw)  # all AdamW by name / shape
    assert [g["use_muon"] for g in opt.param_groups] == [False]
    _run(opt, ours, steps=4)
    _run(torch.optim.AdamW(theirs, **kw), theirs, steps=4)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


class _Draft(nn.Module):
    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.fc = nn.Linear(2 * d, d)
        self.gate = nn.Parameter(torch.randn(1, d))  # a [1, N] row: a vector to Muon
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.frozen = nn.Parameter(torch.randn(d, d), requires_grad=False)


def _groups(opt):
    return {flag: [p for g in opt.param_groups if g["use_muon"] == flag for p in g["params"]] for flag in (True, False)}


def test_split_puts_only_hidden_matrices_on_muon():
    m = _Draft()
    opt = muon_adamw(m.named_parameters(), lr=1e-3, weight_decay=0.01)
    groups = _groups(opt)
    assert groups[True] == [m.fc.weight]
    assert {id(p) for p in groups[False]} == {id(p) for n, p in m.named_parameters() if n != "fc.weight"}
    muon = next(g for g in opt.param_groups if g["use_muon"])
    assert muon["lr"] == pytest.approx(1e-2) and muon["weight_decay"] == 0.01  # null defaults: 10 x lr, AdamW's wd


def test_configure_names_params_only_for_a_named_factory():
    m = _Draft()
    params = [m.lm_head.weight, m.fc.weight, m.fc.bias]  # the caller's order, a subset
    seen = []

    def spy(params, lr):
        seen.append(list(params))
        return torch.optim.SGD([p for _, p in seen[-1]], lr=lr)

    spy.takes_named_params = True
    configure(m, params, partial(spy, lr=0.1), None, total_steps=10)
    assert [n for n, _ in seen[0]] == ["lm_head.weight", "fc.weight", "fc.bias"]
    assert all(a is b for (_, a), b in zip(seen[0], params))

    adamw = configure(m, params, partial(torch.optim.AdamW, lr=0.1), None, total_steps=10)["optimizer"]
    assert "param_names" not in adamw.param_groups[0]  # plain tensors: AdamW runs are unchanged
    assert all(a is b for a, b in zip(adamw.param_groups[0]["params"], params))

    with pytest.raises(ValueError, match="not among"):
        configure(m, [nn.Parameter(torch.zeros(3, 3))], partial(muon_adamw, lr=0.1), None, total_steps=10)


def test_configure_keeps_param_groups_and_schedules_both_parts():
    m = _Draft()
    groups = [{"params": [m.fc.weight, m.norm]}, {"params": [m.lm_head.weight], "lr": 2e-3}]
    factory = partial(muon_adamw, lr=1e-3, muon_lr=0.02)
    out = configure(m, groups, factory, partial(warmup_cosine, warmup_ratio=0.5), total_steps=4)
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert [(g["use_muon"], g["initial_lr"]) for g in opt.param_groups] == [(True, 0.02), (False, 1e-3), (False, 2e-3)]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 5e-4, 1e-3])  # warm-up: half way
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 1e-3, 2e-3])


def _train(m, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
        opt.step()


def test_state_dict_round_trip_resumes():
    torch.manual_seed(0)
    a = _Draft()
    opt_a = muon_adamw(a.named_parameters(), lr=1e-3)
    _train(a, opt_a, 2, seed=1)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # as draftlab loads checkpoints: plain types only

    b = _Draft()
    b.load_state_dict(ckpt["model"])
    opt_b = muon_adamw(b.named_parameters(), lr=1e-3)
    opt_b.load_state_dict(ckpt["optimizer"])
    torch.testing.assert_close(opt_b.state[b.fc.weight]["momentum_buffer"], opt_a.state[a.fc.weight]["momentum_buffer"])
    _train(a, opt_a, 1, seed=2)
    _train(b, opt_b, 1, seed=2)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_config_nodes_build_from_the_method_block():
    method = OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-4,
                               "betas": [0.9, 0.95], "weight_decay": 0.0})
    assert OmegaConf.merge(method, OmegaConf.load(CONF / "adamw.yaml")) == method
    factory = instantiate(OmegaConf.merge(method, OmegaConf.load(CONF / "muon.yaml")))
    m = _Draft()
    opt = configure(m, [p for p in m.parameters() if p.requires_grad], factory, None, total_steps=10)["optimizer"]
    assert isinstance(opt, MuonAdamW) and _groups(opt)[True] == [m.fc.weight]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3) and opt.param_groups[1]["betas"] == (0.9, 0.95)
