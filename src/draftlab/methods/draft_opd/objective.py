"""Draft-OPD's acceptance-aware objective over replayed positions (research notes §2.2, Design 3).

Per replayed position (anchor m, chain position k, 1-based) with target distribution ``p`` and draft
distribution ``q`` over the draft vocabulary (``p`` renormalised there, as EAGLE-3 training does):

    L_acc = mean over accepted positions (k <= r_m) of KL(p || q)                   forward KL
    L_rej = sum over rejected positions (k > r_m) of w_k KL(q || p) / sum w_k,  w_k = gamma^(k-1)
    L     = (lambda_acc L_acc + lambda_rej L_rej) / (lambda_acc + lambda_rej)

(a term with no position in the batch drops out, with its lambda). A loss-menu choice (``menu``,
``draftlab.training.losses``) replaces both KLs with its terms at every position (the hard label: the target's
greedy token); its ``method`` weighting keeps the two streams and their weights above, ``uniform`` is the mean
over replayed positions, ``dpace`` weights each chain's positions by D-PACE. ``estimator="sampled"`` is the official
code's sampled-token form instead: on the committed tokens (accepted ones and the round's correction or
bonus token) a local Bernoulli forward KL ``p log(p/q) + (1-p) log((1-p)/(1-q))`` of their probabilities;
on the rejected tokens (every rejected sibling at r+1, the chain's own tokens after it) the k3 estimator
of KL(q || p), ``p/q - 1 - log(p/q)``, weighted by w_k; log-probs clamped at -10 and each term at 10, the
streams combined as ``(lambda_acc sum_resp + lambda_rej sum_rej w) / (lambda_acc N_resp + lambda_rej sum w)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.training.losses import Loss, chain_weights, hard_confidence, position_losses

ESTIMATORS = ("full", "sampled")
_LOG_FLOOR, _TERM_CAP = -10.0, 10.0


@dataclass
class ReplayBatch:
    """Replayed positions of a batch of anchors, padded to the longest chain K.

    draft_logprobs   [M, K, V] log q (with gradients), log-softmax over the draft vocabulary.
    target_logprobs  [M, K, V] log p at the same columns (full-softmax values; renormalised here).
    valid            [M, K] bool: position k exists in anchor m's chain.
    accepted         [M, K] bool: position k was accepted (k <= r_m).
    committed        [M, K] long: draft-vocabulary id of the committed token at each accepted position and
                     at the first rejected one (its correction / bonus token), -1 elsewhere (sampled only).
    rejected         [M, K, S] long: draft-vocabulary ids of the rejected tokens at each rejected position,
                     -1 padded (sampled only).
    """

    draft_logprobs: torch.Tensor
    target_logprobs: torch.Tensor
    valid: torch.Tensor
    accepted: torch.Tensor
    committed: torch.Tensor | None = None
    rejected: torch.Tensor | None = None


@dataclass
class Objective:
    """The loss settings (every term and weight is config: ``method.module.objective``)."""

    gamma: float = 0.8
    lambda_acc: float = 1.0
    lambda_rej: float = 1.0
    estimator: str = "full"
    # Ablations of the paper's Table: "all forward" / "all reverse" use one divergence at every position.
    divergence: str = "acceptance"  # acceptance | forward | reverse
    menu: Loss | None = None  # the loss menu's choice in place of the two KLs (module docstring)

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"objective.estimator must be one of {ESTIMATORS}, got '{self.estimator}'")
        if self.divergence not in ("acceptance", "forward", "reverse"):
            raise ValueError(f"objective.divergence must be acceptance | forward | reverse, got '{self.divergence}'")
        if self.lambda_acc < 0 or self.lambda_rej < 0 or self.lambda_acc + self.lambda_rej <= 0:
            raise ValueError(f"need lambda_acc, lambda_rej >= 0 with a positive sum, got "
                             f"{self.lambda_acc}, {self.lambda_rej}")
        if self.menu is not None and self.estimator != "full":
            raise ValueError("a loss-menu choice (loss=...) scores full distributions: it needs objective.estimator=full")

    def __call__(self, batch: ReplayBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, stats)``: stats hold the per-stream means and position counts (no gradient)."""
        if self.menu is not None:
            return self._menu(batch)
        if self.estimator == "full":
            return self._full(batch)
        return self._sampled(batch)

    def _split(self, batch: ReplayBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward-KL mask, reverse-KL mask) [M, K] under the configured divergence rule."""
        valid = batch.valid
        if self.divergence == "forward":
            return valid, torch.zeros_like(valid)
        if self.divergence == "reverse":
            return torch.zeros_like(valid), valid
        return valid & batch.accepted, valid & ~batch.accepted

    def _weights(self, batch: ReplayBatch) -> torch.Tensor:
        K = batch.valid.shape[1]
        return self.gamma ** torch.arange(K, dtype=torch.float32, device=batch.valid.device)  # [K] w_k = gamma^(k-1)

    def _combine(self, fwd_sum, fwd_n, rej_sum, rej_w):
        num = self.lambda_acc * fwd_sum + self.lambda_rej * rej_sum
        if self.estimator == "sampled":
            return num / (self.lambda_acc * fwd_n + self.lambda_rej * rej_w).clamp_min(1e-12)
        terms = []
        if fwd_n > 0:
            terms.append((self.lambda_acc, fwd_sum / fwd_n))
        if rej_w > 0:
            terms.append((self.lambda_rej, rej_sum / rej_w))
        if not terms:
            return fwd_sum * 0.0
        return sum(lam * t for lam, t in terms) / max(1e-12, sum(lam for lam, _ in terms))

    def _full(self, batch: ReplayBatch):
        logq = batch.draft_logprobs.float()  # [M, K, V]
        logp = batch.target_logprobs.float()
        logp = logp - torch.logsumexp(logp, -1, keepdim=True)  # renormalised over the draft vocabulary
        p, q = logp.exp(), logq.exp()
        fkl = (p * (logp - logq)).sum(-1)  # [M, K] KL(p || q)
        rkl = (q * (logq - logp)).sum(-1)  # [M, K] KL(q || p)
        fwd, rev = self._split(batch)
        w = self._weights(batch)[None].expand_as(rev) * rev  # [M, K]
        fwd_sum, fwd_n = (fkl * fwd).sum(), fwd.sum()
        rej_sum, rej_w = (rkl * w).sum(), w.sum()
        loss = self._combine(fwd_sum, fwd_n, rej_sum, rej_w)
        return loss, _stats(fkl, rkl, fwd, rev)

    def _menu(self, batch: ReplayBatch):
        logp = batch.target_logprobs.float()
        p = torch.softmax(logp, -1)  # [M, K, V] renormalised over the draft vocabulary
        labels = p.argmax(-1)  # [M, K]
        ell = position_losses(self.menu, batch.draft_logprobs, p, labels)  # [M, K]
        fwd, rev = self._split(batch)
        if self.menu.weighting == "method":
            w = self._weights(batch)[None].expand_as(rev) * rev  # [M, K]
            loss = self._combine((ell * fwd).sum(), fwd.sum(), (ell * w).sum(), w.sum())
        else:
            conf = lambda: hard_confidence(batch.draft_logprobs.detach(), labels)  # noqa: E731
            w = chain_weights(self.menu, torch.ones(()), batch.valid, conf)  # [M, K]
            loss = (ell * w).sum() / w.sum().clamp_min(1e-12)
        return loss, _stats(ell.detach(), ell.detach(), fwd, rev)

    def _sampled(self, batch: ReplayBatch):
        if batch.committed is None or batch.rejected is None:
            raise ValueError("the sampled estimator needs the committed and rejected token ids")
        logq = batch.draft_logprobs.float().clamp_min(_LOG_FLOOR)  # [M, K, V]
        logp = batch.target_logprobs.float()
        logp = (logp - torch.logsumexp(logp, -1, keepdim=True)).clamp_min(_LOG_FLOOR)
        fwd, rev = self._split(batch)
        # Response stream: committed tokens (accepted positions and the first rejected one's correction).
        c = batch.committed
        has_c = (c >= 0) & batch.valid & (fwd | (rev & _first_rejected(batch)))  # [M, K]
        ci = c.clamp_min(0)[..., None]
        lp, lq = logp.gather(-1, ci)[..., 0], logq.gather(-1, ci)[..., 0]  # [M, K]
        pp, qq = lp.exp(), lq.exp()
        bern = pp * (lp - lq) + (1 - pp) * (torch.log1p(-pp.clamp_max(1 - 1e-6)) - torch.log1p(-qq.clamp_max(1 - 1e-6)))
        bern = bern.clamp_max(_TERM_CAP) * has_c
        # Rejected stream: k3 estimate of KL(q || p) at each rejected token.
        r = batch.rejected  # [M, K, S]
        has_r = (r >= 0) & rev[..., None]
        ri = r.clamp_min(0)
        log_ratio = logp.gather(-1, ri) - logq.gather(-1, ri)  # [M, K, S] log(p/q)
        k3 = (log_ratio.exp() - 1 - log_ratio).clamp_max(_TERM_CAP) * has_r
        w = self._weights(batch)[None, :, None] * has_r  # [M, K, S]
        loss = self._combine(bern.sum(), has_c.sum(), (k3 * w).sum(), w.sum())
        return loss, {"fwd_term": _mean(bern, has_c), "rev_term": _mean(k3, has_r),
                      "accepted": fwd.sum().detach(), "rejected": rev.sum().detach()}


def _first_rejected(batch: ReplayBatch) -> torch.Tensor:
    """[M, K] True at each anchor's first rejected position."""
    acc = batch.accepted.long().sum(-1, keepdim=True)  # [M, 1] r_m
    k = torch.arange(batch.valid.shape[1], device=batch.valid.device)[None]  # [1, K] 0-based
    return k == acc


def _mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp_min(1)).detach()


def _stats(fkl, rkl, fwd, rev) -> dict[str, torch.Tensor]:
    return {"fwd_term": _mean(fkl, fwd), "rev_term": _mean(rkl, rev), "accepted": fwd.sum().detach(),
            "rejected": rev.sum().detach()}
