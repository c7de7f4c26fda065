"""Training-time test as one training component: the LightningModule EAGLE-3 and ConFu are both built on.

``TTTTraining`` takes the TTT settings once (the ``module`` block's ``ttt_length``, ``step_weight``, ...,
``optimizer``, ``schedule``) and runs the Lightning steps: each training step unrolls the curriculum's length,
validation ``val_ttt_length``. A method subclasses it and supplies ``loss(batch) -> TTTOutput`` (ConFu hands the
step its own attention over future keys and a row mask). Its parts: ``TTTStep`` holds the settings and runs
``ttt.ttt_forward``; ``TTTMetrics`` logs a step's per-TTT-step statistics and aggregates validation over the
whole split (numerators and denominators summed, across ranks too, before dividing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch

from draftlab.methods.eagle3.ttt import NORMALIZATIONS, TTTAttention, TTTOutput, ttt_forward
from draftlab.nn import simulated_tau
from draftlab.training.losses import Loss
from draftlab.training.schedule import configure

_SUMMED = ("correct", "count", "cond_correct", "cond_count", "accept_sum", "loss_sum", "loss_denom")


def _curriculum(phases) -> tuple[tuple[float, int], ...]:
    """``[[until_fraction, length], ...]`` -> sorted ``((fraction, length), ...)``, checked."""
    out = []
    for i, phase in enumerate(phases or ()):
        if len(phase) != 2:
            raise ValueError(f"ttt_curriculum[{i}] must be [until_fraction, length], got {list(phase)}")
        frac, length = float(phase[0]), int(phase[1])
        if not 0.0 < frac <= 1.0 or length < 1:
            raise ValueError(f"ttt_curriculum[{i}] = {list(phase)}: need 0 < until_fraction <= 1 and length >= 1")
        out.append((frac, length))
    return tuple(sorted(out))


@dataclass
class TTTStep:
    """``ttt_length`` unrolled steps, step k weighted ``step_weight ** k``, losses normalised by
    ``normalization`` (``batch_tokens``: EAGLE/SpecForge; ``mask_sum``: speculators).

    ``curriculum`` ``[[until_fraction, length], ...]``: the optimiser steps before ``until_fraction`` of the
    run unroll ``length`` steps (the first phase that applies), the rest ``ttt_length``: cheap short
    unrolls over many tokens first, the full length last. ``val_ttt_length`` (default ``ttt_length``) is
    the unroll of validation, so runs trained with different lengths are judged on the same chain.
    ``TTTTraining`` sets the length of each step (``use``) before the module computes its loss.
    """

    ttt_length: int = 7
    step_weight: float = 0.8
    normalization: str = "batch_tokens"
    attention: str = "auto"  # ttt_attention's implementation (draftlab.kernels.ttt_attention); naive = brute force
    cross_entropy: str = "auto"  # the loss's soft cross-entropy (draftlab.kernels.soft_cross_entropy)
    curriculum: Sequence[Sequence[float]] | None = None
    val_ttt_length: int | None = None
    loss: Loss | None = None  # the loss menu's choice (draftlab.training.losses); None: the soft cross-entropy

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got '{self.normalization}'")
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if self.val_ttt_length is not None and self.val_ttt_length < 1:
            raise ValueError(f"val_ttt_length must be >= 1, got {self.val_ttt_length}")
        self.curriculum = _curriculum(self.curriculum)
        self.active = self.ttt_length

    def train_length(self, step: int, total_steps: int) -> int:
        """Unroll length of optimiser step ``step`` (0-based) of ``total_steps``."""
        progress = step / max(1, total_steps)
        return next((length for frac, length in self.curriculum if progress < frac), self.ttt_length)

    @property
    def eval_length(self) -> int:
        return self.val_ttt_length or self.ttt_length

    def use(self, length: int) -> None:
        """Unroll ``length`` steps in the following calls."""
        self.active = int(length)

    def __call__(self, draft, input_ids: torch.Tensor, aux: torch.Tensor, logits: torch.Tensor,
                 loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, *,
                 attention: TTTAttention | None = None, row_mask: torch.Tensor | None = None) -> TTTOutput:
        return ttt_forward(draft, input_ids, aux, logits, loss_mask, attention_mask, ttt_length=self.active,
                           step_weight=self.step_weight, normalization=self.normalization,
                           impl=self.attention, cross_entropy=self.cross_entropy, attention=attention, row_mask=row_mask,
                           loss=self.loss)


class TTTMetrics:
    """``train/*`` per step and ``val/*`` per epoch for a module trained with ``TTTStep`` outputs.

    Train: ``loss``, ``ploss_k``, ``acc_k``, ``cond_acc_k``, ``acceptance_rate_k``. Validation: the same from
    split-wide sums, plus ``val/simulated_tau`` = 1 + Σ_k Π_{j≤k} cond_acc_j (expected tokens per verify
    round of a greedy chain, bonus included; the checkpoint metric) and SpecForge's
    ``val/simulated_acc_len`` = Σ_k Π_{j≤k} acc_j.
    """

    def __init__(self, step_weight: float):
        self.step_weight = step_weight
        self._val: list[dict[str, torch.Tensor]] | None = None

    def log_train(self, module, out: TTTOutput, batch_size: int) -> None:
        logs = {"train/loss": out.loss.detach()}
        for k, s in enumerate(out.per_step):
            logs[f"train/ploss_{k}"] = s["loss"].detach()
            logs[f"train/acc_{k}"] = s["acc"]
            logs[f"train/cond_acc_{k}"] = s["cond_acc"]
            logs[f"train/acceptance_rate_{k}"] = s["acceptance_rate"]
        module.log_dict(logs, batch_size=batch_size, prog_bar=False)
        module.log("train/acc_0_bar", out.per_step[0]["acc"], batch_size=batch_size, prog_bar=True, logger=False)

    def start_validation(self) -> None:
        self._val = None

    def add_validation(self, out: TTTOutput) -> None:
        sums = [{name: s[name].detach().double() for name in _SUMMED} for s in out.per_step]
        if self._val is None:
            self._val = sums
            return
        for acc, new in zip(self._val, sums):
            for name in _SUMMED:
                acc[name] = acc[name] + new[name]

    def log_validation(self, module) -> None:
        if self._val is None:
            return
        # Sum numerators and denominators across ranks, then divide (averaging ratios would be wrong).
        stacked = torch.stack([torch.stack([s[n] for n in _SUMMED]) for s in self._val])  # [K, 7]
        stacked = module.trainer.strategy.reduce(stacked.to(module.device), reduce_op="sum").cpu()
        logs, acc, cond = {}, [], []
        total = 0.0
        for k, row in enumerate(stacked.tolist()):
            s = dict(zip(_SUMMED, row))
            acc.append(s["correct"] / max(1.0, s["count"]))
            cond.append(s["cond_correct"] / max(1.0, s["cond_count"]))
            ploss = s["loss_sum"] / max(1e-12, s["loss_denom"])
            total += self.step_weight ** k * ploss
            logs[f"val/acc_{k}"] = acc[-1]
            logs[f"val/cond_acc_{k}"] = cond[-1]
            logs[f"val/acceptance_rate_{k}"] = s["accept_sum"] / max(1.0, s["count"])
            logs[f"val/ploss_{k}"] = ploss
        logs["val/loss"] = total
        logs["val/simulated_tau"] = simulated_tau(cond)
        logs["val/simulated_acc_len"] = simulated_tau(acc, include_bonus=False)
        module.log_dict({k: float(v) for k, v in logs.items()}, sync_dist=False)
        self._val = None


class TTTTraining(L.LightningModule):
    """A draft trained by TTT against a frozen target; subclasses define ``loss(batch) -> TTTOutput``.

    draft          the draft being trained; ``target`` the frozen target (a plain attribute: never in
                   ``state_dict``, never wrapped by DDP/FSDP), None where every batch is offline.
    ttt_length     K unrolled steps; ``step_weight`` ** k weights step k; ``normalization`` is
                   ``batch_tokens`` (EAGLE/SpecForge) or ``mask_sum`` (speculators).
    ttt_curriculum ``[[until_fraction, length], ...]``: shorter unrolls for the first fractions of the run
                   (``TTTStep``); ``val_ttt_length`` the unroll of validation (default ``ttt_length``).
    optimizer      a partial ``torch.optim`` constructor (Hydra ``_partial_: true``): the method config's,
                   required to fit; ``schedule`` a partial LR schedule (``draftlab.training.schedule``).
    attention      the TTT attention's kernel (``draftlab.kernels.ttt_attention``; ``auto``: Triton on CUDA,
                   blockwise elsewhere); ``cross_entropy`` the loss's (``draftlab.kernels.soft_cross_entropy``).
                   Neither changes the loss, so neither enters the training key.
    loss           the loss menu's choice (``conf/loss``; ``draftlab.training.losses.Loss``): terms in place of the
                   soft cross-entropy, and ``weighting`` (``method`` keeps ``step_weight``); None: today's loss.
    """

    def __init__(self, draft, target=None, *, ttt_length: int = 7, step_weight: float = 0.8,
                 normalization: str = "batch_tokens", optimizer=None, schedule=None, total_steps: int | None = None,
                 ttt_curriculum=None, val_ttt_length: int | None = None, attention: str = "auto",
                 cross_entropy: str = "auto", loss=None):
        super().__init__()
        self.draft = draft
        self.target = target
        self.ttt = TTTStep(ttt_length, step_weight, normalization, attention, cross_entropy, ttt_curriculum,
                           val_ttt_length, Loss.of(loss))
        self.metrics = TTTMetrics(step_weight)
        self.optimizer_factory = optimizer  # conf/method/<m>.yaml's module.optimizer: its defaults live there
        self.schedule_factory = schedule
        self.total_steps = total_steps

    @property
    def ttt_length(self) -> int:
        return self.ttt.ttt_length

    def loss(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        raise NotImplementedError

    def trained_parameters(self):
        """The parameters the optimiser steps (one group; a method with several learning rates overrides
        ``configure_optimizers``)."""
        return [p for p in self.draft.parameters() if p.requires_grad]

    def configure_optimizers(self):
        return configure(self, self.trained_parameters(), self.optimizer_factory, self.schedule_factory,
                         self.total_steps)

    # ---- Lightning steps: each training step unrolls the curriculum's length, validation val_ttt_length ----

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.ttt.curriculum:
            total = self.total_steps or int(self.trainer.estimated_stepping_batches)
            self.ttt.use(self.ttt.train_length(int(self.global_step), total))
        else:
            self.ttt.use(self.ttt.ttt_length)
        out = self.loss(batch)
        self.metrics.log_train(self, out, batch["input_ids"].shape[0])
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self.ttt.use(self.ttt.eval_length)
        self.metrics.start_validation()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.metrics.add_validation(self.loss(batch))

    def on_validation_epoch_end(self) -> None:
        self.metrics.log_validation(self)
