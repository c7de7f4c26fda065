"""The loss menu in every trainable method: routed by config, out of the training key unless chosen, and the
methods' own losses recovered exactly where the menu names them (DFlash's CE, EAGLE-3's soft CE gradient,
Draft-OPD's forward KL)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.configs import compose_train_config
from draftlab.data.template import RenderedSample
from draftlab.methods.draft_opd.objective import Objective, ReplayBatch
from draftlab.methods.registry import MethodSpec
from draftlab.targets.base import PassRequest
from draftlab.training.losses import Loss
from draftlab.utils.hashing import content_key
from tests.decoding.conformance.methods import on_device, sequences, spec, untrained_draft, vocab_for
from tests.methods.corpus import TRAIN_PROMPTS

# The training keys' method part before the loss menu existed (content_key(MethodSpec.key_config())): a default
# run must keep reusing the drafts trained before it.
KEYS_BEFORE_THE_MENU = {
    "eagle3": "ecd4e75809c908fc", "confu": "0dd72a22b1003fff", "confu_no_moe": "64d2f8f652e59e13",
    "eagle3_continue": "ecd4e75809c908fc", "dflash": "f088f82871215798", "dflash2": "01b836bf502bce9a",
    "dspark": "10ee19b281a76272", "draft_opd": "82f73e32c9d63c93", "specbound": "394402ce70d98776",
    "ssd_eagle3": "5fb96155f84970dd",
}
TRAINABLE = ["eagle3", "confu", "dflash", "dflash2", "dspark", "draft_opd", "specbound", "ssd_eagle3"]


def _key(*overrides: str) -> str:
    return content_key(MethodSpec(compose_train_config(list(overrides)).method).key_config())


@pytest.mark.parametrize("method", sorted(KEYS_BEFORE_THE_MENU))
def test_the_default_keeps_every_training_key(method):
    assert _key(f"method={method}") == KEYS_BEFORE_THE_MENU[method]
    assert _key(f"method={method}", "optimizer=adamw") == KEYS_BEFORE_THE_MENU[method]  # the method's own optimiser
    assert _key(f"method={method}", "loss=kl") != KEYS_BEFORE_THE_MENU[method]  # a chosen loss is in the key


@pytest.mark.parametrize("method", TRAINABLE)
def test_loss_lands_in_the_module_that_trains(method):
    cfg = compose_train_config([f"method={method}", "loss=tv", "loss.weighting=uniform"])
    where = "method.base.module" if method == "ssd_eagle3" else "method.module"
    assert OmegaConf.to_container(OmegaConf.select(cfg, f"{where}.loss")) == {"name": "tv", "terms": {"tv": 1.0},
                                                                              "weighting": "uniform"}
    assert "loss" not in cfg  # routed once


def _samples(target):
    seqs = sequences(target)
    return [RenderedSample(input_ids=s, loss_mask=[0] * (len(p) - 1) + [1] * (len(s) - len(p) + 1), id=f"{i}")
            for i, (p, s) in enumerate(zip(TRAIN_PROMPTS, seqs))]


def _with_loss(name: str, loss: dict | None) -> MethodSpec:
    s = copy.deepcopy(spec(name))
    if loss is not None:
        owner = "module" if OmegaConf.select(s.cfg, "module._target_") else "base.module"
        OmegaConf.update(s.cfg, f"{owner}.loss", loss, force_add=True)
    return s


def _batch(s: MethodSpec, target, draft):
    dm = s.build_datamodule(_samples(target), features=None, pad_token_id=target.tokenizer.pad_token_id or 0, seed=0)
    dm.setup("fit")
    return on_device(next(iter(dm.train_dataloader())), target.device)


def _step(name: str, loss: dict | None, target, batch=None):
    """(loss, grads by parameter name, batch) of one training step of a fresh draft (the same draft every call)."""
    s = _with_loss(name, loss)
    vocab = vocab_for(s, target, sequences(target))  # the corpus first: its first computation draws numbers
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draft = s.build_draft(target, vocab)
        module = s.build_module(draft, target)
        batch = batch if batch is not None else _batch(s, target, draft)
        torch.manual_seed(1)  # the step's own draws (DFlash's anchors) the same in every call
        out = module.training_step({k: v for k, v in batch.items()}, 0)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}, batch


@pytest.mark.parametrize("method", ["eagle3", "confu", "dflash", "dflash2", "dspark", "specbound"])
def test_every_supervised_module_trains_under_a_soft_mix_and_dpace(method, tiny_target):
    weighting = "uniform" if method == "specbound" else "dpace"  # SpecBound's heads draft no chain
    loss, grads, _ = _step(method, {"terms": {"lk": 0.5, "jsd": 0.25, "ce": 0.25}, "weighting": weighting},
                           tiny_target)
    assert torch.isfinite(loss) and loss > 0
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum() for g in grads.values()) > 0


def test_specbound_refuses_dpace(tiny_target):
    with pytest.raises(ValueError, match="no chain of positions"):
        _step("specbound", {"terms": {"kl": 1.0}, "weighting": "dpace"}, tiny_target)


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_the_menus_ce_with_the_methods_weighting_is_the_block_familys_own_loss(method, tiny_target):
    own, own_grads, batch = _step(method, None, tiny_target)
    menu, menu_grads, _ = _step(method, {"terms": {"ce": 1.0}, "weighting": "method"}, tiny_target, batch)
    assert torch.allclose(menu, own, rtol=1e-6, atol=1e-7)
    for name, g in own_grads.items():
        assert torch.allclose(menu_grads[name], g, rtol=1e-4, atol=1e-7), name


def test_the_menus_kl_has_eagle3s_soft_cross_entropy_gradient(tiny_target):
    """KL and the soft CE differ by the teacher's entropy, a constant: their gradients are equal."""
    own, own_grads, batch = _step("eagle3", None, tiny_target)
    menu, menu_grads, _ = _step("eagle3", {"terms": {"kl": 1.0}, "weighting": "method"}, tiny_target, batch)
    assert menu < own  # minus the entropy
    for name, g in own_grads.items():
        assert torch.allclose(menu_grads[name], g, rtol=1e-4, atol=1e-8), name


def test_the_dflash_teacher_is_the_targets_distribution_one_position_before_the_label(tiny_target):
    from draftlab.methods.dflash.blocks import make_blocks
    from draftlab.methods.dflash.objective import teacher_probs

    s, draft = untrained_draft("dflash", tiny_target)
    ids = torch.tensor([sequences(tiny_target)[0]], device=tiny_target.device)
    out = tiny_target.forward(ids, request=PassRequest(last_hidden=True))
    c = draft.config
    blocks = make_blocks(ids, torch.ones_like(ids), torch.ones_like(ids), block_size=c.block_size,
                         mask_token_id=c.mask_token_id, num_anchors=3, generator=torch.Generator().manual_seed(0))
    p = teacher_probs(draft, out.last_hidden, blocks)  # [1, A, K, V]
    for j, a in enumerate(blocks.anchors[0].tolist()):
        for k in range(p.shape[2]):
            if a + k < ids.shape[1]:
                want = torch.softmax(out.logits[0, a + k].float(), -1)
                assert torch.allclose(p[0, j, k], want, atol=1e-5)


def _replay(seed: int = 0) -> ReplayBatch:
    g = torch.Generator().manual_seed(seed)
    M, K, V = 3, 4, 9
    logq = torch.log_softmax(torch.randn(M, K, V, generator=g), -1).requires_grad_(True)
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    accepted = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool) & valid
    return ReplayBatch(logq, torch.log_softmax(torch.randn(M, K, V, generator=g), -1), valid, accepted)


def test_draft_opds_forward_kl_is_the_menus_kl_at_every_position():
    own, _ = Objective(divergence="forward")(_replay())
    menu, _ = Objective(divergence="forward", menu=Loss(terms={"kl": 1.0}))(_replay())
    assert torch.allclose(own, menu, atol=1e-6)
    # The acceptance split, with the menu's KL on both streams, weighs the rejected positions by gamma^(k-1).
    split, _ = Objective(menu=Loss(terms={"kl": 1.0}))(_replay())
    assert not torch.allclose(split, menu)
    with pytest.raises(ValueError, match="estimator=full"):
        Objective(estimator="sampled", menu=Loss())
