"""The training-loss menu: per-position divergences between the target's distribution and the draft's, mixed
by weight, and the position weighting that turns them into one loss (``draftlab-train loss=<name>``).

Notation per drafted position: ``z`` the draft's logits, ``q = softmax(z)``, ``p`` the target's distribution over
the same columns (a method's teacher: EAGLE-3's renormalised draft-vocabulary ``p``, DFlash's full-vocabulary
target distribution at the slot), ``y`` the hard label the method trains on (the target's greedy token for
EAGLE-3, Draft-OPD and SpecBound; the target-written sequence token for the DFlash family), and
``alpha = sum_v min(p_v, q_v)``, the chance speculative sampling accepts a token drawn from ``q``.

========  =====================================  ==========================================================
name      per position                           gradient in ``z``
========  =====================================  ==========================================================
kl        ``sum p (log p - log q)``               ``q * sum(p) - p`` (today's EAGLE-3 soft CE, less H(p))
rkl       ``sum q (log q - log p)``               ``q * (log q - log p - rkl)``
jsd       ``KL(p||m)/2 + KL(q||m)/2``, m=(p+q)/2  autograd (bounded by log 2)
tv        ``sum |p - q| / 2`` (``= 1 - alpha``)   ``q * (s - sum q s)``, ``s = sign(q - p) / 2``: zero where p = q
ce        ``-log q_y``                            ``q - onehot(y)``
nla       ``-log max(alpha, 1e-5)``               TV's, times ``1 / alpha`` (trains from a cold start)
lk        ``lam KL + (1 - lam) TV``               ``lam = exp(-eta sg(alpha))``: KL far from the target, TV near
========  =====================================  ==========================================================

``kl``, ``rkl``, ``jsd``, ``tv``, ``ce``, ``nla`` follow speculators' ``loss_functions.md`` (``ce`` there is on
``argmax p``); ``nla`` and ``lk`` are Samarin et al., "LK Losses" (arXiv 2602.23881), ``eta = 3``.

Position weighting (``weighting``) over a chain of drafted positions ``k = 1..K`` (a DFlash block's slots, the
steps of EAGLE-3's training-time test from one row, a Draft-OPD replayed chain):

- ``method``: the method's own (EAGLE-3 ``step_weight ** (k-1)``, DFlash ``exp(-(k-1)/gamma)``, Draft-OPD ``gamma``);
- ``uniform``: 1 at every position;
- ``dpace``: D-PACE (arXiv 2605.18810, as speculators' ``dpace_loss_decay``): with ``c_k = exp(-CE_k)`` the
  draft's detached confidence in the label, ``s_k = (1 - a) c_k + a`` (``a = dpace_alpha``, 0.5), masked
  positions ``s = 1``: ``w_k = valid_k * sum_{j >= k} valid_j prod_{l <= j} s_l``, the expected accepted run
  that position k's error would cut. Detached: it weights, it is not trained.

Memory: ``position_losses`` runs row chunks through one autograd function that saves only its inputs (the
draft logits and the teacher, which exist anyway) and recomputes each chunk in backward, so no loss keeps an
fp32 ``[N, V]`` temporary beyond one chunk's (as the chunked soft cross-entropy does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAMES = ("kl", "rkl", "jsd", "tv", "ce", "nla", "lk")
SOFT = frozenset({"kl", "rkl", "jsd", "tv", "nla", "lk"})  # the terms that read the teacher distribution p
WEIGHTINGS = ("method", "uniform", "dpace")
NLA_FLOOR = 1e-5
CHUNK_ELEMENTS = 1 << 24  # rows per chunk = CHUNK_ELEMENTS // V: ~64 MiB per fp32 temporary


# ---- per-row terms: z [n, V] (float, grad), p [n, V] or None, y [n] or None -> [n] -----------------------


def _logs(z: torch.Tensor, p: torch.Tensor):
    logq = F.log_softmax(z, -1)
    logp = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))
    return logq, logp


def _kl(z, p, y, _):
    logq, logp = _logs(z, p)
    return (p * (logp - logq)).sum(-1) * (p.sum(-1) > 0)  # xlogy: p = 0 terms are 0 (logp is finite)


def _rkl(z, p, y, _):
    logq, logp = _logs(z, p)
    return (logq.exp() * (logq - logp)).sum(-1)


def _jsd(z, p, y, _):
    logq, logp = _logs(z, p)
    logm = torch.logaddexp(logp, logq) - math.log(2.0)  # log((p + q) / 2), finite where q underflows
    return 0.5 * ((p * (logp - logm)).sum(-1) + (logq.exp() * (logq - logm)).sum(-1))


def _tv(z, p, y, _):
    return 0.5 * (torch.softmax(z, -1) - p).abs().sum(-1)  # |.|'s gradient at 0 is 0: none where p = q


def _alpha(z, p):
    return torch.minimum(torch.softmax(z, -1), p).sum(-1)


def _ce(z, p, y, _):
    return F.cross_entropy(z, y, reduction="none")


def _nla(z, p, y, _):
    return -torch.log(_alpha(z, p).clamp_min(NLA_FLOOR))


def _lk(z, p, y, eta):
    lam = torch.exp(-eta * _alpha(z, p).detach())
    return lam * _kl(z, p, y, eta) + (1 - lam) * _tv(z, p, y, eta)


_TERMS: dict[str, Callable] = {"kl": _kl, "rkl": _rkl, "jsd": _jsd, "tv": _tv, "ce": _ce, "nla": _nla, "lk": _lk}


# ---- the loss settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loss:
    """A weighted mix of terms and a position weighting (``conf/loss/*.yaml``; ``method.module.loss``).

    terms        ``{name: weight}`` over ``NAMES`` (weights as given, not normalised; e.g. ``{ce: 0.1, tv: 0.9}``).
    weighting    ``method`` | ``uniform`` | ``dpace`` (module docstring).
    dpace_alpha  D-PACE's confidence smoothing; ``lk_eta`` LK's blend rate.
    """

    terms: Mapping[str, float] = field(default_factory=lambda: {"kl": 1.0})
    weighting: str = "method"
    dpace_alpha: float = 0.5
    lk_eta: float = 3.0

    def __post_init__(self):
        terms = dict(self.terms or {})
        if not terms:
            raise ValueError(f"loss.terms is empty; name at least one of {NAMES}")
        for name, w in terms.items():
            if name not in _TERMS:
                raise ValueError(f"unknown loss term '{name}' in loss.terms; choose from {NAMES}")
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"loss.terms.{name} must be a finite weight >= 0, got {w!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"loss.weighting must be one of {WEIGHTINGS}, got '{self.weighting}'")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"loss.dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        object.__setattr__(self, "terms", {k: float(v) for k, v in terms.items()})

    @classmethod
    def of(cls, cfg) -> Loss | None:
        """A ``Loss`` from a config mapping (or None / a ``Loss``), as modules receive ``loss=``."""
        if cfg is None or isinstance(cfg, Loss):
            return cfg
        cfg = dict(cfg)
        cfg.pop("name", None)  # the config file's label
        return cls(**cfg)

    @property
    def needs_teacher(self) -> bool:
        """Whether a term reads the target's distribution (else the hard labels are enough)."""
        return any(name in SOFT for name in self.terms)

    def row_loss(self, z: torch.Tensor, p: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor:
        """The mix on one chunk of rows, plain autograd: ``z [n, V]`` (computed in at least fp32)."""
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if p is not None:
            p = p.to(z.dtype)
        out = None
        for name, w in self.terms.items():
            term = w * _TERMS[name](z, p, y, self.lk_eta)
            out = term if out is None else out + term
        return out


class _RowChunked(torch.autograd.Function):
    """``loss.row_loss`` over row chunks; saves the inputs only and recomputes each chunk in backward."""

    @staticmethod
    def forward(ctx, logits, p, y, loss, rows):
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
        with torch.no_grad():
            for a in range(0, n, rows):
                out[a:a + rows] = loss.row_loss(logits[a:a + rows], _rows(p, a, rows), _rows(y, a, rows))
        ctx.save_for_backward(logits, p, y)
        ctx.loss, ctx.rows = loss, rows
        return out

    @staticmethod
    def backward(ctx, g):
        logits, p, y = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.rows):
            with torch.enable_grad():
                z = logits[a:a + ctx.rows].detach().requires_grad_(True)
                val = ctx.loss.row_loss(z, _rows(p, a, ctx.rows), _rows(y, a, ctx.rows))
                (gz,) = torch.autograd.grad(val, z, g[a:a + ctx.rows].to(val.dtype))
            grad[a:a + ctx.rows] = gz
        return grad, None, None, None, None


def _rows(t: torch.Tensor | None, a: int, n: int) -> torch.Tensor | None:
    return None if t is None else t[a:a + n]


def position_losses(loss: Loss, logits: torch.Tensor, p: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                    *, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-position loss ``[...]`` of ``logits [..., V]`` against the teacher ``p [..., V]`` (no gradient) and
    the hard ``labels [...]`` (long; masked positions may hold any valid id). fp32 (fp64 stays fp64)."""
    if loss.needs_teacher and p is None:
        raise ValueError(f"loss terms {sorted(set(loss.terms) & SOFT)} need the target's distribution p")
    if "ce" in loss.terms and labels is None:
        raise ValueError("loss term 'ce' needs the hard labels")
    lead, v = logits.shape[:-1], logits.shape[-1]
    if p is not None and p.shape != logits.shape:
        raise ValueError(f"teacher p {tuple(p.shape)} and logits {tuple(logits.shape)} differ")
    z = logits.reshape(-1, v)
    pp = None if p is None else p.detach().reshape(-1, v)
    yy = None if labels is None else labels.reshape(-1)
    rows = max(1, min(z.shape[0], chunk_elements // max(v, 1)))
    with torch.autocast(logits.device.type, enabled=False):  # one dtype from forward to backward
        return _RowChunked.apply(z, pp, yy, loss, rows).reshape(lead)


# ---- position weighting ---------------------------------------------------------------------------------


@torch.no_grad()
def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights ``[..., K]`` from the draft's confidence in the label ``exp(-CE) [..., K]`` along each chain
    (last dim = chain position) and ``valid [..., K]`` (module docstring)."""
    valid = valid.to(confidence.dtype)
    smooth = torch.where(valid > 0, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
    reach = torch.cumprod(smooth, dim=-1) * valid  # [..., K] chance the run reaches and includes position j
    suffix = reach.flip(-1).cumsum(-1).flip(-1)  # [..., K] sum over j >= k
    return suffix * valid


def hard_confidence(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``exp(-CE)`` of ``labels [...]`` under ``logits [..., V]``, detached (D-PACE's per-position confidence)."""
    with torch.no_grad():
        lse = torch.logsumexp(logits.float(), -1)
        return torch.exp(logits.float().gather(-1, labels[..., None])[..., 0] - lse)


def chain_weights(loss: Loss, method_weights: torch.Tensor, valid: torch.Tensor,
                  confidence: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Weights ``[..., K]`` of the chain positions under ``loss.weighting``: the method's ``method_weights``
    (broadcast), ones, or D-PACE from ``confidence()`` (called only then: it costs a pass over the logits)."""
    valid_f = valid.float()
    if loss.weighting == "method":
        return method_weights.to(valid_f) * valid_f
    if loss.weighting == "uniform":
        return valid_f
    return dpace_weights(confidence(), valid, loss.dpace_alpha)
