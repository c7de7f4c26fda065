"""Exit-head training and calibration as a LightningModule (the base model stays frozen).

Each step runs the frozen target over a batch of conversations (under ``no_grad``), keeps the residual
stream after every exit layer and the final logits, and trains each head's ``W_l`` on
``KL(p_final || p_l)`` over the loss positions (at most ``max_positions`` of them per batch, drawn at
random, since every head costs a ``[n, V]`` LM head pass).

Validation scores every held-out loss position and reports, per exit layer ``l``:

- ``val/agree_l{l}``: top-1 agreement of the head with the final layer; ``val/kl_l{l}``;
- ``val/raw_exit_rate_l{l}``, ``val/raw_exit_precision_l{l}``: share of positions whose head confidence
  (max softmax) passes ``tau``, and the agreement among them, *before* ACT;
- ``val/exit_rate_l{l}``, ``val/exit_precision_l{l}``: the same with ACT (logits / ``T_l``);

and for the drafting policy (first head with ACT confidence >= ``tau`` up to ``d_max``, at most ``w_max``
tokens): ``val/policy_exit_rate``, ``val/mean_exit_layer`` and ``val/simulated_tau``, the expected tokens
per round along the held-out text (consecutive positions whose first exit agrees with the final layer,
capped at ``w_max``, plus the token of the completion pass): the checkpoint metric.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import torch

from draftlab.methods.specbound.heads import ExitHeads, act_temperature
from draftlab.training.losses import Loss, position_losses
from draftlab.training.schedule import configure, warmup_cosine

_CHUNK = 256  # rows per LM-head chunk in validation ([chunk, V] at a time)


def layer_states(target, input_ids: torch.Tensor, exit_layers) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Residual streams ``{l: [B, T, d]}`` after each exit layer and after the last layer (no cache: causal)."""
    h = target.embed(input_ids)  # [B, T, d]
    states, start = {}, 0
    for layer in exit_layers:
        h = target.forward_layers(h, start, layer).hidden
        states[layer], start = h, layer
    return states, target.forward_layers(h, start, target.geometry.num_layers).hidden


def first_exit(conf: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], tau: float, d_max: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: exited (bool), its exit layer (0 where none) and whether that head agreed with the final."""
    layers = [layer for layer in sorted(conf) if layer <= d_max]
    any_row = next(iter(conf.values()))
    exited = torch.zeros_like(any_row, dtype=torch.bool)
    layer_of = torch.zeros_like(any_row, dtype=torch.long)
    right = torch.zeros_like(any_row, dtype=torch.bool)
    for layer in layers:
        new = (conf[layer] >= tau) & ~exited
        layer_of[new] = layer
        right |= new & agree[layer]
        exited |= new
    return exited, layer_of, right


def chain_lengths(success: torch.Tensor, valid: torch.Tensor, w_max: int) -> torch.Tensor:
    """``[B, T]``: consecutive successes from each position within the valid positions, capped at ``w_max``."""
    B, T = success.shape
    run = torch.zeros(B, T + 1, dtype=torch.long)
    ok = (success & valid).cpu()
    for t in range(T - 1, -1, -1):
        run[:, t] = torch.where(ok[:, t], run[:, t + 1] + 1, 0)
    return run[:, :T].clamp(max=w_max)


class SpecBoundModule(L.LightningModule):
    """Trains :class:`ExitHeads` on a frozen target (see the module docstring).

    alpha, tau, d_max, w_max  ACT and the bounds used by the validation metrics (the drafter has its own,
                  defaulting to these); ``d_max`` None = the deepest exit layer.
    max_positions loss positions per training batch (random subset); None = all.
    loss          the loss menu's choice (``conf/loss``) in place of ``KL(p_final || p_l)``: its terms against the
                  final layer's distribution and greedy token. Each head drafts one position, so there is no
                  chain to weight: ``weighting`` must be ``method`` or ``uniform`` (the same here).
    """

    def __init__(self, draft: ExitHeads, target, *, alpha: float = 1.0, tau: float = 0.8, d_max: int | None = None,
                 w_max: int = 6, max_positions: int | None = 512, optimizer=None, schedule=None,
                 total_steps: int | None = None, loss=None):
        super().__init__()
        self.loss = Loss.of(loss)
        if self.loss is not None and self.loss.weighting == "dpace":
            raise ValueError("SpecBound's exit heads each draft one position from their layer: there is no chain of "
                             "positions for D-PACE to weight (loss.weighting: method | uniform)")
        if target is None:
            raise ValueError("SpecBound trains on the target's own forward: the module needs the target")
        draft.check_target(target)
        self.draft = draft
        self.target = target  # not an nn.Module attribute of the checkpoint
        self.alpha, self.tau = float(alpha), float(tau)
        self.d_max = int(d_max) if d_max is not None else max(draft.exit_layers)
        self.w_max = int(w_max)
        self.max_positions = max_positions
        self.optimizer_factory = optimizer  # conf/method/<m>.yaml's module.optimizer: its defaults live there
        self.schedule_factory = schedule or partial(warmup_cosine, warmup_ratio=0.05)
        self.total_steps = total_steps
        self._val: dict[str, torch.Tensor] | None = None
        self.save_hyperparameters(ignore=["draft", "target", "optimizer", "schedule"])

    # ---- training -----------------------------------------------------------------------------------

    def _positions(self, batch: dict[str, torch.Tensor], limit: int | None) -> torch.Tensor:
        mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, T]
        idx = mask.flatten().nonzero().squeeze(1)  # [n] into B*T
        if limit is not None and idx.numel() > limit:
            idx = idx[torch.randperm(idx.numel(), device=idx.device)[:limit]]
        return idx

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx = self._positions(batch, self.max_positions)
        with torch.no_grad():
            states, final = layer_states(self.target, batch["input_ids"], self.draft.exit_layers)
            d = final.shape[-1]
            logp_final = torch.log_softmax(self.target.lm_head(final.reshape(1, -1, d)[:, idx]).float(), -1)  # [1, n, V]
            p_final = logp_final.exp()
        losses = {}
        for layer in self.draft.exit_layers:
            h = states[layer].reshape(1, -1, d)[:, idx]  # [1, n, d]
            logq = torch.log_softmax(self.draft.logits(self.target, h, layer).float(), -1)  # [1, n, V]
            if self.loss is None:
                losses[layer] = (p_final * (logp_final - logq)).sum(-1).mean()  # KL(p_final || p_l)
            else:
                losses[layer] = position_losses(self.loss, logq, p_final, p_final.argmax(-1)).mean()
        loss = torch.stack(list(losses.values())).sum()
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss.detach(), batch_size=bs, prog_bar=True)
        self.log_dict({f"train/kl_l{layer}": v.detach() for layer, v in losses.items()}, batch_size=bs)
        return loss

    # ---- validation: calibration before / after ACT and the drafting policy -------------------------

    def on_validation_epoch_start(self) -> None:
        self._val = None

    @torch.no_grad()
    def position_stats(self, batch: dict[str, torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
        """Per exit layer, ``[B, T]`` tensors: head confidence raw / with ACT, agreement with the final layer, KL."""
        states, final = layer_states(self.target, batch["input_ids"], self.draft.exit_layers)
        B, T, d = final.shape
        L_ = self.target.geometry.num_layers
        out: dict[str, dict[int, torch.Tensor]] = {k: {} for k in ("raw", "act", "agree", "kl")}
        for layer in self.draft.exit_layers:
            temp = act_temperature(layer, L_, self.alpha)
            cols = {k: [] for k in out}
            for s in range(0, B * T, _CHUNK):
                hf = final.reshape(-1, d)[s:s + _CHUNK][None]
                hl = states[layer].reshape(-1, d)[s:s + _CHUNK][None]
                logp = torch.log_softmax(self.target.lm_head(hf).float()[0], -1)  # [c, V]
                z = self.draft.logits(self.target, hl, layer).float()[0]  # [c, V]
                logq = torch.log_softmax(z, -1)
                cols["raw"].append(logq.max(-1).values.exp())
                cols["act"].append(torch.softmax(z / temp, -1).max(-1).values)
                cols["agree"].append(z.argmax(-1) == logp.argmax(-1))
                cols["kl"].append((logp.exp() * (logp - logq)).sum(-1))
            for k in out:
                out[k][layer] = torch.cat(cols[k]).view(B, T)
        return out

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        stats = self.position_stats(batch)
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, T]
        sums: dict[str, torch.Tensor] = {"n": valid.sum().double()}
        for layer in self.draft.exit_layers:
            agree = stats["agree"][layer] & valid
            for name, conf in (("raw", stats["raw"][layer]), ("act", stats["act"][layer])):
                ex = (conf >= self.tau) & valid
                sums[f"{name}_exit_{layer}"] = ex.sum().double()
                sums[f"{name}_right_{layer}"] = (ex & agree).sum().double()
            sums[f"agree_{layer}"] = agree.sum().double()
            sums[f"kl_{layer}"] = (stats["kl"][layer] * valid).sum().double()
        exited, layer_of, right = first_exit(stats["act"], stats["agree"], self.tau, self.d_max)
        exited, right = exited & valid, right & valid
        sums["policy_exit"] = exited.sum().double()
        sums["policy_layer"] = (layer_of * exited).sum().double()
        sums["chain"] = chain_lengths(right, valid, self.w_max)[valid.cpu()].sum().double()
        sums = {k: v.cpu() for k, v in sums.items()}
        self._val = sums if self._val is None else {k: self._val[k] + v for k, v in sums.items()}

    def on_validation_epoch_end(self) -> None:
        if self._val is None:
            return
        s = {k: float(v) for k, v in self._val.items()}
        n = max(s["n"], 1.0)
        logs = {}
        for layer in self.draft.exit_layers:
            logs[f"val/agree_l{layer}"] = s[f"agree_{layer}"] / n
            logs[f"val/kl_l{layer}"] = s[f"kl_{layer}"] / n
            for name, prefix in (("raw", "val/raw_"), ("act", "val/")):
                exits = s[f"{name}_exit_{layer}"]
                logs[f"{prefix}exit_rate_l{layer}"] = exits / n
                logs[f"{prefix}exit_precision_l{layer}"] = s[f"{name}_right_{layer}"] / max(exits, 1.0)
        logs["val/policy_exit_rate"] = s["policy_exit"] / n
        logs["val/mean_exit_layer"] = s["policy_layer"] / max(s["policy_exit"], 1.0)
        logs["val/simulated_tau"] = 1.0 + s["chain"] / n
        logs["val/loss"] = sum(logs[f"val/kl_l{layer}"] for layer in self.draft.exit_layers)
        self.log_dict(logs, sync_dist=False)
        self._val = None

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        return configure(self, params, self.optimizer_factory, self.schedule_factory, self.total_steps)

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["specbound_config"] = self.draft.config.to_dict()

    def on_load_checkpoint(self, checkpoint) -> None:
        saved = checkpoint.get("specbound_config")
        if saved is not None and saved != self.draft.config.to_dict():
            raise ValueError("checkpoint was trained with other exit heads:\n"
                             f"  checkpoint: {saved}\n  this run:   {self.draft.config.to_dict()}")
