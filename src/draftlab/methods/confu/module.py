"""ConFu training: EAGLE-3 training-time test with contemplate rows at sampled anchors.

One step, for a batch of B right-padded sequences of length N:

1. Target pass A (frozen, ``no_grad``) over the N tokens into a fresh target cache: aux features, teacher
   logits and the prefix keys/values.
2. K anchors per sequence among the response positions (``sample_anchors``), each with a ``[con]`` key
   lag in ``[1, max_con_lag]`` (see ``contemplate``'s docstring for why the key lags).
3. Target pass B (``contemplate``): s soft prompts + K contemplate rows, WITH grad w.r.t. the soft prompts
   and the ``[con]`` MoE, through the frozen target, attending to the cached (constant) keys/values of
   their prefix. N + s + K target rows in all, not 2N.
4. Per anchor: ``f = fc(h_con)``, ``e_f = MoE_f(fc(F_a))``, and the future row's keys/values.
5. EAGLE-3 TTT (``eagle3.ttt.ttt_forward``) where row t additionally attends to the future of its window
   (``future_visibility``; the replication knobs live in ``ConFuConfig``); rows without a future are
   left out of the loss at every step. Soft-label loss only, as EAGLE-3.

Offline features are not used: pass B needs the target's keys/values of the prefix, which only a target
pass gives, so the target always runs inside the step (its aux states and logits then come for free).
"""

from __future__ import annotations

from typing import Any

import torch

from draftlab.methods.confu.config import ConFuConfig
from draftlab.methods.confu.contemplate import contemplate
from draftlab.methods.confu.model import ConFuDraft, FutureTTTAttention, future_visibility
from draftlab.methods.eagle3.module import load_draft_checkpoint, save_draft_checkpoint
from draftlab.methods.eagle3.ttt import TTTOutput
from draftlab.methods.eagle3.ttt_training import TTTTraining
from draftlab.targets.base import PassRequest


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, num_anchors: int, *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B, K]`` anchors per sequence, ascending, drawn uniformly without replacement; -1 pads short rows.

    Candidates are response positions (``loss_mask``) whose next token is real (the anchor row consumes
    it); ``K = min(num_anchors, N)``.
    """
    B, T = loss_mask.shape
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(loss_mask, dtype=torch.bool)
    cand = loss_mask.bool() & real  # [B, T]
    cand[:, :-1] &= real[:, 1:]
    cand[:, -1] = False
    k = min(num_anchors, T)
    scores = torch.rand(B, T, generator=generator).to(loss_mask.device)  # [B, T]
    scores = scores.masked_fill(~cand, -1.0)
    top, idx = scores.topk(k, dim=-1)  # [B, K]
    idx = torch.where(top >= 0, idx, torch.full_like(idx, T))
    idx = idx.sort(dim=-1).values
    return torch.where(idx < T, idx, torch.full_like(idx, -1))


def sample_lags(anchors: torch.Tensor, max_lag: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B, K]`` lags in ``[1, max_lag]`` for the ``[con]`` key, capped so that ``anchor - lag >= 0``."""
    lags = torch.randint(1, max_lag + 1, anchors.shape, generator=generator).to(anchors.device)
    return torch.minimum(lags, anchors.clamp(min=0))


class ConFuModule(TTTTraining):
    """Trains a :class:`ConFuDraft` (draft, soft prompts, both MoEs) against a frozen target.

    EAGLE-3's training (``ttt_training.TTTTraining``: the TTT settings, steps, metrics, optimiser; the
    draft-checkpoint helpers) with ConFu's own target pass B and future keys.

    num_anchors  K_train, contemplate rows per sequence.
    max_con_lag  the ``[con]`` MoE key is the target feature ``lag`` positions before the anchor, lag
                 uniform in ``[1, max_con_lag]`` (at inference: the round's accept length).
    confu_lr     learning rate of the ConFu parameters (soft prompts, MoEs, ``fc_f``); None = the optimiser's.
    **ttt        the TTT settings, optimiser and schedule, as ``Eagle3Module``'s.
    """

    def __init__(self, draft: ConFuDraft, target=None, *, num_anchors: int = 64, max_con_lag: int = 4,
                 confu_lr: float | None = None, **ttt):
        if not isinstance(draft, ConFuDraft):
            raise TypeError(f"ConFuModule trains a ConFuDraft, got {type(draft).__name__}")
        if target is None:
            raise ValueError("ConFu trains with the target in the loop: contemplate rows need its KV cache")
        if num_anchors < 1 or max_con_lag < 1:
            raise ValueError(f"need num_anchors >= 1 and max_con_lag >= 1, got {num_anchors}, {max_con_lag}")
        super().__init__(draft, target, **ttt)
        self.num_anchors = num_anchors
        self.max_con_lag = max_con_lag
        self.confu_lr = confu_lr
        self.save_hyperparameters(ignore=["draft", "target", "optimizer", "schedule"])

    def loss(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        """The TTT output (loss + per-step statistics) of ``batch``, anchors sampled."""
        return self.confu_forward(batch)

    def confu_forward(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor | None = None,
                      lags: torch.Tensor | None = None) -> TTTOutput:
        """The training loss of ``batch`` (module docstring); ``anchors`` / ``lags`` [B, K] fix the sampling."""
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        attn = batch.get("attention_mask")
        B, T = ids.shape
        cache = self.target.new_cache(B, T)
        taps = self.draft.taps(self.target)
        with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):  # the target in its own precision
            out = self.target.forward(ids, cache=cache, request=PassRequest(aux=taps))
        cache.commit(T)
        aux, logits = out.aux_hidden, out.logits  # [B, T, 3*d_t], [B, T, V]
        if anchors is None:
            anchors = sample_anchors(loss_mask, attn, self.num_anchors)
        anchors = anchors.to(ids.device)
        if lags is None:
            lags = sample_lags(anchors, self.max_con_lag)
        lags = lags.to(ids.device)
        draft = self.draft
        a = anchors.clamp(min=0)
        width = aux.shape[-1]
        key_aux = aux.gather(1, (a - lags).clamp(min=0)[..., None].expand(-1, -1, width))  # [B, K, 3*d_t]
        anchor_aux = aux.gather(1, a[..., None].expand(-1, -1, width))  # [B, K, 3*d_t]
        con_aux = contemplate(self.target, cache, draft.soft_prompts, draft.contemplate_embedding(key_aux), anchors,
                              aux_layer_ids=taps)
        f = draft.future_vector(con_aux)  # [B, K, d]
        e_f = draft.future_embedding(anchor_aux)  # [B, K, d]
        future_kv = draft.future_kv(e_f, f, a)  # L x ([B, Hkv, K, hd], [B, Hkv, K, hd])
        visible = future_visibility(anchors, T, draft.config.future_window)  # [B, T, K]
        attention = FutureTTTAttention(None if attn is None else attn.bool(), future_kv, visible,
                                       impl=self.ttt.attention)
        return self.ttt(draft, ids, aux, logits, loss_mask, attn, attention=attention, row_mask=visible.any(-1))

    # ---- optimisation: the ConFu parameters may take their own learning rate -------------------------

    def trained_parameters(self):
        params = super().trained_parameters()
        if self.confu_lr is None:
            return params
        confu = {id(p) for p in self.draft.confu_parameters()}
        return [{"params": [p for p in params if id(p) not in confu]},
                {"params": [p for p in params if id(p) in confu], "lr": self.confu_lr}]

    # ---- checkpoints: the draft (frozen embedding dropped) and its ConFu config ------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_draft_checkpoint(checkpoint, "confu_config", self.draft.config.to_dict())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_draft_checkpoint(checkpoint, "confu_config", self.draft, ConFuConfig)
