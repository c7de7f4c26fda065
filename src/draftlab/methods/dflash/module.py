"""DFlash training as a LightningModule: random-anchor blocks over a frozen target, online or offline.

Feature modes (chosen per batch by what the batch holds):

- **online**: tokens only; the frozen target runs inside the step under ``no_grad`` and returns the
  tapped layers (``aux_layer_ids = draft.taps(target)``); its LM head is skipped, because
  DFlash trains on the (target-regenerated) tokens themselves, not on target logits;
- **offline**: the batch also holds ``aux [B, T, n_taps*d]`` read from a feature store (``data.py``).

Checkpoints hold the draft's own weights only: the target is a plain attribute and the shared
embedding / LM head are non-persistent buffers. ``dflash_config`` is stored beside the weights.

Metrics: ``train/loss`` and ``train/acc_k`` (block slot k = 1..B-1) per step; validation sums
numerators and denominators over the split (and ranks) and reports ``val/loss``, ``val/acc_k``,
``val/cond_acc_k`` and ``val/simulated_tau`` = 1 + sum_k prod_{j<=k} cond_acc_j, the expected tokens
per verify round of the greedy block chain (bonus included) on held-out data: the checkpoint metric.
Validation anchors come from a fixed-seed generator, so every epoch scores the same blocks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import torch

from draftlab.methods.dflash.blocks import SUMMED, BlockOutput, block_logits, block_loss, make_blocks
from draftlab.methods.dflash.config import default_gamma
from draftlab.methods.dflash.model import DFlashDraft
from draftlab.methods.dflash.objective import menu_block_loss, teacher_probs
from draftlab.nn import simulated_tau
from draftlab.targets.base import PassRequest
from draftlab.training.losses import Loss
from draftlab.training.schedule import configure, warmup_cosine


class DFlashModule(L.LightningModule):
    """Trains a :class:`DFlashDraft` against a frozen target (see the module docstring).

    draft         the draft (sharing the target's embedding and LM head).
    target        a ``draftlab.targets.Target`` for online batches; None when every batch is offline.
    num_anchors   blocks per sequence (the paper: 512 on GPUs; a few dozen on CPU).
    gamma         loss decay ``w_k = exp(-(k-1)/gamma)``; None = the paper's value for the block size.
    optimizer     a partial ``torch.optim`` constructor (Hydra ``_partial_: true``): the config's, required to fit.
    schedule      a partial LR schedule (``draftlab.training.schedule``); default warm-up 4 % + cosine.
    val_seed      seed of the validation anchors.
    loss          the loss menu's choice (``conf/loss``; ``methods/dflash/objective.py``); None: DFlash's own CE.
    """

    def __init__(self, draft: DFlashDraft, target=None, *, num_anchors: int = 32, gamma: float | None = None,
                 optimizer=None, schedule=None, total_steps: int | None = None, val_seed: int = 0, loss=None):
        super().__init__()
        self.draft = draft
        self.target = target  # not an nn.Module: never in state_dict, never wrapped by DDP/FSDP
        self.num_anchors = int(num_anchors)
        self.gamma = float(gamma) if gamma is not None else default_gamma(draft.config.block_size)
        self.optimizer_factory = optimizer  # conf/method/<m>.yaml's module.optimizer: its defaults live there
        self.schedule_factory = schedule or partial(warmup_cosine, warmup_ratio=0.04)
        self.total_steps = total_steps
        self.val_seed = val_seed
        self.loss = Loss.of(loss)
        self._val: dict[str, torch.Tensor] | None = None
        self._val_gen: torch.Generator | None = None
        self.save_hyperparameters(ignore=["draft", "target", "optimizer", "schedule"])

    # ---- features and the block loss -------------------------------------------------------------------

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads the target's distribution (a soft term of the loss menu)."""
        return self.loss is not None and self.loss.needs_teacher

    def target_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``aux [B, T, n_taps*d]``: stored in the batch (offline) or computed by the frozen target (online).

        When the loss needs the teacher, an online pass also puts the final-norm states into
        ``batch["last_hidden"]`` (offline batches carry the store's)."""
        if "aux" in batch:
            return batch["aux"]
        if self.target is None:
            raise RuntimeError("online batch (tokens only) but the module has no target")
        with torch.no_grad():
            # Right padding + causal attention: padded rows never reach real ones. No LM head (empty rows).
            no_logits = torch.arange(0, device=batch["input_ids"].device)
            out = self.target.forward(batch["input_ids"], request=PassRequest(
                aux=self.draft.taps(self.target), logits_rows=no_logits, last_hidden=self.needs_teacher))
        if self.needs_teacher:
            batch["last_hidden"] = out.last_hidden
        return out.aux_hidden

    def slot_loss(self, logits: torch.Tensor, blocks, batch: dict[str, torch.Tensor]) -> BlockOutput:
        """The loss of slot logits ``[B, A, K, V]``: DFlash's own, or the loss menu's (every DFlash-family module
        scores its slots through here)."""
        if self.loss is None:
            return block_loss(logits, blocks, self.gamma)
        teacher = None
        if self.needs_teacher:
            if "last_hidden" not in batch:
                raise RuntimeError("the loss needs the target's distribution but the batch has no last_hidden "
                                   "(an offline store without final states?)")
            teacher = teacher_probs(self.draft, batch["last_hidden"], blocks)
        return menu_block_loss(logits, blocks, self.gamma, self.loss, teacher)

    def block_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None):
        """Sample blocks for ``batch`` and return the ``BlockOutput`` (loss + per-slot sums)."""
        c = self.draft.config
        aux = self.target_features(batch)
        blocks = make_blocks(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], block_size=c.block_size,
                             mask_token_id=c.mask_token_id, num_anchors=self.num_anchors, generator=generator)
        return self.slot_loss(block_logits(self.draft, aux, blocks), blocks, batch)

    # ---- steps -----------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.block_step(batch)
        s = out.per_slot
        acc = s["correct"] / s["count"].clamp_min(1.0)  # [bs-1]
        logs = {"train/loss": out.loss.detach()}
        logs.update({f"train/acc_{k}": acc[k - 1].float() for k in range(1, acc.numel() + 1)})
        bs = batch["input_ids"].shape[0]
        self.log_dict(logs, batch_size=bs)
        self.log("train/acc_1_bar", acc[0].float(), batch_size=bs, prog_bar=True, logger=False)
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self._val = None
        self._val_gen = torch.Generator().manual_seed(self.val_seed)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self._val_gen is None:
            self.on_validation_epoch_start()
        out = self.block_step(batch, self._val_gen)
        sums = {**{k: v.detach() for k, v in out.per_slot.items()},
                "loss_sum": out.loss_sum.detach().double()[None], "weight_sum": out.weight_sum.detach().double()[None]}
        self._val = sums if self._val is None else {k: self._val[k] + v for k, v in sums.items()}

    def on_validation_epoch_end(self) -> None:
        if self._val is None:
            return
        names = [*SUMMED, "loss_sum", "weight_sum"]
        K = self._val["correct"].numel()
        flat = torch.cat([self._val[n].reshape(-1) for n in names]).to(self.device)
        # Sum numerators and denominators across ranks, then divide (averaging ratios would be wrong).
        flat = self.trainer.strategy.reduce(flat, reduce_op="sum").cpu()
        parts = dict(zip(SUMMED, flat[: 4 * K].view(4, K)))
        acc = (parts["correct"] / parts["count"].clamp_min(1.0)).tolist()
        cond = (parts["cond_correct"] / parts["cond_count"].clamp_min(1.0)).tolist()
        logs = {"val/loss": float(flat[4 * K] / flat[4 * K + 1].clamp_min(1e-12))}
        for k in range(1, K + 1):
            logs[f"val/acc_{k}"] = acc[k - 1]
            logs[f"val/cond_acc_{k}"] = cond[k - 1]
        logs["val/simulated_tau"] = simulated_tau(cond)
        self.log_dict(logs, sync_dist=False)
        self._val = None

    # ---- optimisation ----------------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        return configure(self, params, self.optimizer_factory, self.schedule_factory, self.total_steps)

    # ---- checkpoints: draft weights only ---------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dflash_config"] = self.draft.config.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("dflash_config")
        if saved is not None and type(self.draft.config).from_dict(saved) != self.draft.config:
            raise ValueError("checkpoint was trained with a different DFlash config:\n"
                             f"  checkpoint: {saved}\n  this run:   {self.draft.config.to_dict()}")
