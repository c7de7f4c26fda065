"""TTT unroll schedule: a curriculum of short unrolls first, a fixed validation unroll, bf16 autocast that
keeps the target's distribution in fp32."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from draftlab.methods.eagle3.data import Eagle3DataModule
from draftlab.methods.eagle3.module import Eagle3Module
from draftlab.methods.eagle3.ttt_training import TTTStep
from tests.methods.test_eagle3_module import make_draft, make_samples


def test_curriculum_phases_by_fraction_of_steps():
    step = TTTStep(ttt_length=5, curriculum=[[0.6, 3], [0.3, 1]])
    assert [step.train_length(s, 10) for s in range(10)] == [1, 1, 1, 3, 3, 3, 5, 5, 5, 5]
    assert TTTStep(ttt_length=4).train_length(0, 10) == 4
    assert step.eval_length == 5 and TTTStep(ttt_length=2, val_ttt_length=6).eval_length == 6


@pytest.mark.parametrize("bad", [[[0.0, 2]], [[1.5, 2]], [[0.5, 0]], [[0.5]]])
def test_bad_curriculum_names_the_entry(bad):
    with pytest.raises(ValueError, match=r"ttt_curriculum\[0\]"):
        TTTStep(ttt_length=4, curriculum=bad)


class _Lengths(L.Callback):
    """Records how many TTT steps each training batch and each validation epoch unrolled."""

    def __init__(self):
        self.train: list[int] = []
        self.val: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(pl_module.ttt.active)

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val.append(pl_module.ttt.active)


def test_training_follows_the_curriculum_and_validates_at_full_length(tiny_target, tmp_path):
    samples = make_samples(tiny_target, 12)
    module = Eagle3Module(make_draft(tiny_target, samples), tiny_target, ttt_length=3,
                          ttt_curriculum=[[0.5, 1]], val_ttt_length=4,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0))
    dm = Eagle3DataModule(samples, batch_size=3, val_fraction=0.25)
    seen = _Lengths()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path), callbacks=[seen])
    trainer.fit(module, datamodule=dm)
    assert seen.train == [1, 1, 1, 3, 3, 3]  # 3 batches per epoch, 2 epochs: the first half unrolls once
    assert seen.val == [4, 4]
    # The validation metrics cover the whole validation chain, whatever the training unroll was.
    assert "val/acc_3" in trainer.callback_metrics and "val/acc_4" not in trainer.callback_metrics


def test_bf16_autocast_leaves_the_target_distribution_in_fp32(tiny_target, tmp_path):
    from draftlab.data.features import precompute_features

    samples = make_samples(tiny_target, 4)
    module = Eagle3Module(make_draft(tiny_target, samples), tiny_target, ttt_length=2)
    feats = precompute_features(tiny_target, samples, tmp_path / "feats")
    for features in (None, feats):  # online (the target runs in the step) and offline (its stored states)
        dm = Eagle3DataModule(samples, batch_size=4, val_fraction=0.0, feature_dir=features)
        dm.setup()
        batch = next(iter(dm.train_dataloader()))
        _, want = module.target_features(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, got = module.target_features(batch)
            draft_loss = module.loss(batch).loss
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.isfinite(draft_loss)
