"""The DFlash LightningModule: it learns, online == offline features, metrics, draft-only checkpoints."""

from __future__ import annotations

import random

import lightning as L
import torch

from draftlab.data.features import precompute_features
from draftlab.data.template import RenderedSample
from draftlab.methods.dflash import build_draft
from draftlab.methods.dflash.data import DFlashDataModule
from draftlab.methods.dflash.module import DFlashModule
from tests.methods.corpus import greedy

BS = 4


def make_samples(target, n=6, seed=0) -> list[RenderedSample]:
    """Random prompts continued greedily by the target (the regenerated responses DFlash trains on)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randint(100, 5000) for _ in range(rng.randint(3, 6))]
        seq = greedy(target, prompt, rng.randint(10, 16))
        mask = [0] * len(prompt) + [1] * (len(seq) - len(prompt))
        out.append(RenderedSample(input_ids=seq, loss_mask=mask, id=f"s{i}"))
    return out


def test_a_few_steps_lower_the_loss(tiny_target):
    samples = make_samples(tiny_target)
    draft = build_draft(tiny_target, num_layers=1, block_size=BS, seed=0)
    module = DFlashModule(draft, tiny_target, num_anchors=8)
    dm = DFlashDataModule(samples, batch_size=6, val_fraction=0.0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)

    def loss():
        return module.block_step(batch, torch.Generator().manual_seed(0)).loss

    first = float(loss().detach())
    for _ in range(15):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert float(loss().detach()) < 0.8 * first
    # The target's shared tensors were not touched by the optimiser.
    assert draft.lm_head_weight.data_ptr() == tiny_target.model.get_output_embeddings().weight.data_ptr()


def test_online_and_offline_features_give_the_same_loss(tiny_target, tmp_path):
    samples = make_samples(tiny_target, 4)
    draft = build_draft(tiny_target, num_layers=1, block_size=BS, seed=0)
    module = DFlashModule(draft, tiny_target, num_anchors=6)
    store = precompute_features(tiny_target, samples, tmp_path / "feats",
                                aux_layer_ids=draft.taps(tiny_target))
    online = DFlashDataModule(samples, batch_size=4, val_fraction=0.0)
    offline = DFlashDataModule(samples, batch_size=4, val_fraction=0.0, feature_dir=store)
    online.setup()
    offline.setup()
    b_on, b_off = next(iter(online.train_dataloader())), next(iter(offline.train_dataloader()))
    assert torch.equal(b_on["input_ids"], b_off["input_ids"])
    assert "aux" in b_off and "aux" not in b_on
    assert b_off["aux"].shape[-1] == draft.config.num_taps * tiny_target.geometry.hidden_size
    l_on = module.block_step(b_on, torch.Generator().manual_seed(3)).loss
    l_off = module.block_step(b_off, torch.Generator().manual_seed(3)).loss
    assert torch.allclose(l_on, l_off, rtol=1e-5, atol=1e-6)


def test_fit_logs_metrics_and_checkpoints_hold_the_draft_only(tiny_target, tmp_path):
    samples = make_samples(tiny_target, 8, seed=1)
    draft = build_draft(tiny_target, num_layers=1, block_size=BS, seed=0)
    module = DFlashModule(draft, tiny_target, num_anchors=6,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3))
    dm = DFlashDataModule(samples, batch_size=4, val_fraction=0.3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(module, dm)
    m = trainer.callback_metrics
    for key in ("train/loss", "train/acc_1", "val/loss", "val/acc_1", "val/cond_acc_3", "val/simulated_tau"):
        assert key in m, key
    assert 1.0 <= float(m["val/simulated_tau"]) <= BS
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert set(saved["state_dict"]) == {f"draft.{k}" for k in draft.state_dict()}
    assert saved["dflash_config"] == draft.config.to_dict()
