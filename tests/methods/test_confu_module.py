"""ConFu training: anchors, no future leakage through replication, where gradients go, N + K target rows,
and a Lightning run with checkpoints."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch

import draftlab.methods.confu.module as module_lib
from draftlab.data.template import RenderedSample
from draftlab.data.vocab import build_vocab_mapping
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate
from draftlab.methods.confu import ConFuDraft, ConFuModule, sample_anchors, sample_lags
from draftlab.methods.eagle3.data import Eagle3DataModule

VD = 128


def _batch(target, n=30, prompt=6, seed=0):
    # A prompt of random tokens continued greedily by the target (so its argmax is in the draft vocab).
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(100, 3000, (prompt,), generator=g).tolist()
    new, _ = autoregressive_generate(target, p, GenerationConfig(max_new_tokens=n - prompt, stop_on_eos=False))
    loss_mask = torch.zeros(1, n)
    loss_mask[0, prompt:] = 1
    return {"input_ids": torch.tensor([p + new]), "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "loss_mask": loss_mask}


def _draft(target, seqs=None, **kw) -> ConFuDraft:
    torch.manual_seed(0)
    freq = torch.ones(target.geometry.vocab_size)
    for seq in seqs if seqs is not None else _batch(target)["input_ids"].tolist():
        freq[torch.tensor(seq)] += 100  # the vocabulary of the test sequences comes first
    kw.setdefault("num_soft_prompts", 4)
    return ConFuDraft.from_target(target, vocab_mapping=build_vocab_mapping(freq, VD), intermediate_size=96, **kw)


def _step_logits(module, batch, anchors, lags):
    # (the draft logits [T, V_d] of every TTT step, the TTTOutput) of one training forward.
    steps: list[torch.Tensor] = []
    hook = module.draft.lm_head.register_forward_hook(lambda m, i, o: steps.append(o[0]))
    try:
        out = module.confu_forward(batch, anchors, lags)
    finally:
        hook.remove()
    return steps, out


def test_anchor_sampling():
    loss_mask = torch.zeros(3, 12)
    loss_mask[0, 4:] = 1
    loss_mask[1, 2:5] = 1
    attn = torch.ones(3, 12, dtype=torch.bool)
    attn[1, 6:] = False
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(loss_mask, attn, 4, generator=g)  # [3, 4]
    assert anchors.shape == (3, 4)
    a0 = anchors[0].tolist()
    assert a0 == sorted(set(a0)) and all(4 <= a <= 10 for a in a0)  # a response row with a next token
    assert sorted(anchors[1].tolist()) == [-1, 2, 3, 4]  # only three candidates
    assert anchors[2].tolist() == [-1] * 4
    lags = sample_lags(anchors, 3, generator=g)
    valid = anchors >= 0
    assert (lags[valid] >= 1).all() and (lags[valid] <= 3).all() and (lags <= anchors.clamp(min=0)).all()
    # Uniform over the candidates: every response row of sequence 0 gets picked across draws.
    seen = set()
    for _ in range(30):
        seen |= set(sample_anchors(loss_mask, attn, 2, generator=g)[0].tolist())
    assert seen == set(range(4, 11))


def test_target_rows_are_n_plus_s_plus_k(tiny_target, monkeypatch):
    """Pass A runs the N tokens once (no grad); pass B only the soft prompts and K contemplate rows."""
    module = ConFuModule(_draft(tiny_target), tiny_target, ttt_length=2)
    batch = _batch(tiny_target, n=30)
    calls = []
    fwd, fwd_grad = type(tiny_target).forward, type(tiny_target).forward_with_grad

    def embeds(a, kw):
        return (a[4] if len(a) > 4 else kw["request"]).input_embeds

    def spy(self, *a, **kw):
        x = a[0] if a and a[0] is not None else embeds(a, kw)
        calls.append(("forward", x.shape[1], torch.is_grad_enabled()))
        return fwd(self, *a, **kw)

    def spy_grad(self, *a, **kw):
        calls.append(("forward_with_grad", embeds(a, kw).shape[1], torch.is_grad_enabled()))
        return fwd_grad(self, *a, **kw)

    monkeypatch.setattr(type(tiny_target), "forward", spy)
    monkeypatch.setattr(type(tiny_target), "forward_with_grad", spy_grad)
    module.confu_forward(batch, torch.tensor([[8, 12, 20]]))
    assert [c[:2] for c in calls] == [("forward", 30), ("forward_with_grad", 4 + 3)]
    assert calls[1][2]  # contemplate rows run with grad


@pytest.mark.parametrize("num_layers", [1, 2])
def test_replication_never_leaks_a_later_anchors_future(tiny_target, num_layers, monkeypatch):
    """Changing anchor 2's contemplate input changes rows from anchor 2 on, never a row before it, at any
    TTT step; and the gradient of the earlier rows w.r.t. anchor 2's future vector is exactly zero."""
    module = ConFuModule(_draft(tiny_target, num_layers=num_layers, replicate_length=8), tiny_target, ttt_length=3)
    batch = _batch(tiny_target, n=30)
    anchors = torch.tensor([[7, 15]])
    base, _ = _step_logits(module, batch, anchors, torch.tensor([[1, 1]]))
    other, _ = _step_logits(module, batch, anchors, torch.tensor([[1, 4]]))  # anchor 2's [con] key moves
    for k, (a, b) in enumerate(zip(base, other)):
        assert torch.allclose(a[:15], b[:15], atol=1e-6, rtol=0), k
        assert (a[15:23] - b[15:23]).abs().amax() > 1e-4, k  # the window of anchor 2 does see it

    futures = []
    vector = ConFuDraft.future_vector

    def keep(self, con_aux):
        f = vector(self, con_aux)
        f.retain_grad()
        futures.append(f)
        return f

    monkeypatch.setattr(ConFuDraft, "future_vector", keep)
    steps, _ = _step_logits(module, batch, anchors, torch.tensor([[1, 1]]))
    sum(s[:15].sum() for s in steps).backward()
    grad = futures[0].grad[0]  # [K, d]
    assert grad[0].abs().sum() > 0 and torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_replication_switch_and_rows_without_a_future(tiny_target):
    """Rows outside every anchor's window are left out of the loss at every step; replication off keeps
    only the anchor rows."""
    batch = _batch(tiny_target, n=30)
    batch["loss_mask"][:] = 1
    anchors = torch.tensor([[7, 15]])
    for replicate, want in [(True, 8), (False, 2)]:
        module = ConFuModule(_draft(tiny_target, replicate=replicate, replicate_length=4), tiny_target,
                             ttt_length=2)
        out = module.confu_forward(batch, anchors, torch.tensor([[1, 1]]))
        assert [int(s["count"]) for s in out.per_step] == [want, want]


def test_gradients_reach_confu_parameters_only_through_contemplate_rows(tiny_target, monkeypatch):
    module = ConFuModule(_draft(tiny_target), tiny_target, ttt_length=2)
    draft = module.draft
    batch = _batch(tiny_target)
    anchors = torch.tensor([[8, 12, 20]])
    module.confu_forward(batch, anchors).loss.backward()
    for name in ["soft_prompts", "con_moe.experts", "con_moe.router.weight", "f_moe.experts", "f_moe.router.weight",
                 "fc.weight", "midlayer.self_attn.q_proj.weight"]:
        p = dict(draft.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert draft.embed_tokens.weight.grad is None
    assert all(p.grad is None for p in tiny_target.model.parameters())

    # Cut the contemplate rows' output from the graph: soft prompts and the [con] MoE lose every gradient.
    draft.zero_grad(set_to_none=True)
    contemplate = module_lib.contemplate
    monkeypatch.setattr(module_lib, "contemplate", lambda *a, **kw: contemplate(*a, **kw).detach())
    module.confu_forward(batch, anchors).loss.backward()
    assert draft.soft_prompts.grad is None and draft.con_moe.experts.grad is None
    assert draft.f_moe.experts.grad.abs().sum() > 0


def _samples(target, n=8, seed=0) -> list[RenderedSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randint(100, 5000) for _ in range(rng.randint(3, 6))]
        new, _ = autoregressive_generate(target, prompt, GenerationConfig(max_new_tokens=rng.randint(10, 16),
                                                                          stop_on_eos=False))
        out.append(RenderedSample(input_ids=prompt + new, loss_mask=[0] * len(prompt) + [1] * len(new), id=f"s{i}"))
    return out


def test_lightning_fit_learns_and_checkpoints_the_confu_draft(tiny_target, tmp_path):
    samples = _samples(tiny_target)
    draft = _draft(tiny_target, [s.input_ids for s in samples])
    module = ConFuModule(draft, tiny_target, num_anchors=8, ttt_length=2, confu_lr=1e-2,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
    dm = Eagle3DataModule(samples, batch_size=4, val_fraction=0.25)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    torch.manual_seed(1)
    before = float(module.loss(batch).loss.detach())
    soft_before = draft.soft_prompts.detach().clone()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    torch.manual_seed(1)
    after = float(module.loss(batch).loss.detach())
    assert after < 0.8 * before, (before, after)
    assert not torch.allclose(draft.soft_prompts, soft_before)
    opt = trainer.optimizers[0]
    assert [g["initial_lr"] for g in opt.param_groups] == [pytest.approx(3e-3), pytest.approx(1e-2)]
    assert len(opt.param_groups[1]["params"]) == len(draft.confu_parameters())

    ckpt_path = next(tmp_path.rglob("*.ckpt"))
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["confu_config"]["num_soft_prompts"] == 4 and "eagle3_config" not in ckpt
    assert {"draft.soft_prompts", "draft.con_moe.experts", "draft.f_moe.router.weight"} <= set(ckpt["state_dict"])
    fresh = ConFuModule(_draft(tiny_target, [s.input_ids for s in samples]), tiny_target)
    fresh.on_load_checkpoint(ckpt)
    fresh.load_state_dict(ckpt["state_dict"])
    assert torch.equal(fresh.draft.soft_prompts, draft.soft_prompts)
    other = ConFuModule(_draft(tiny_target, n_experts=4), tiny_target)
    with pytest.raises(ValueError, match="different ConFu draft config"):
        other.on_load_checkpoint(torch.load(ckpt_path, weights_only=False))
