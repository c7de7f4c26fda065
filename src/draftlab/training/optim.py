"""Muon for the hidden weight matrices, AdamW for everything else, as one ``torch.optim.Optimizer``.

Chosen by config (``draftlab-train optimizer=muon``, conf/optimizer/muon.yaml), which merges the Muon knobs into
the method's AdamW block, so the run's ``lr`` / ``betas`` / ``weight_decay`` stay the AdamW part's::

    optimizer: {_target_: draftlab.training.optim.muon_adamw, _partial_: true, lr: 1.0e-4, betas: [0.9, 0.95]}

One optimiser rather than speculators' ``[Muon, AdamW]`` pair: Lightning, the LR schedules (``schedule.py``),
checkpoints and resume all expect one, and each param group says by its ``use_muon`` flag which update it takes.
The split needs parameter names, so :func:`muon_adamw` takes ``(name, param)`` pairs (``takes_named_params``:
``schedule.configure`` looks them up in the module).
"""

from __future__ import annotations

import math

import torch

from draftlab.utils.logging import get_logger

log = get_logger(__name__)

# Keller Jordan's quintic Newton–Schulz coefficients and normalisation eps (torch.optim.Muon's too).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# 2-D parameters kept on AdamW by name: token embeddings and output heads are vocabulary lookups / read-outs, not
# hidden transforms (Keller Jordan's and speculators' ``embed_tokens`` / ``lm_head``, widened to any embed / head).
ADAMW_NAME_HINTS = ("embed", "head", "codebook")  # per-token rows (DFlash2's selector codebooks) too


def orthogonalise(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = NS_EPS) -> torch.Tensor:
    """About ``U Vᵀ`` of ``update = U S Vᵀ``, in ``dtype``: the quintic is tuned for a steep slope at 0, so five
    steps leave the singular values in roughly [0.68, 1.13] rather than at exactly 1 (harmless for training)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide orientation: its Gram matrix X Xᵀ is the smaller one
        x = x.T
    x = x / (x.norm() + eps)  # the Frobenius norm bounds the spectral norm: singular values start in [0, 1]
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # aX + (bA + cA²)X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's step size for a ``[rows, cols]`` matrix, as ``torch.optim.Muon``'s ``adjust_lr_fn``."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        # An orthogonal update has entry RMS 1/sqrt(max(rows, cols)); this makes it 0.2, AdamW's typical update
        # RMS, so AdamW's lr and weight decay carry over (Moonshot, "Muon is Scalable for LLM Training").
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))  # Keller Jordan's original: scale up tall matrices only


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum, Newton–Schulz orthogonalised, decoupled weight decay) on the param groups with
    ``use_muon`` (2-D parameters only), AdamW on the others. A group's keys override the defaults below."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = "match_rms_adamw", ns_dtype: str = "bfloat16"):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "use_muon": False,
                    "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                    "ns_dtype": ns_dtype}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
                raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}")
            if not isinstance(getattr(torch, str(group["ns_dtype"]), None), torch.dtype):
                raise ValueError(f"ns_dtype must name a torch dtype (e.g. bfloat16), got {group['ns_dtype']!r}")
            shapes = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            if shapes:
                raise ValueError(f"Muon orthogonalises 2-D matrices only; its group has shapes {shapes}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon if group["use_muon"] else self._adamw
            for p in group["params"]:
                if p.grad is not None:
                    update(p, p.grad, group, self.state[p])
        return loss

    @staticmethod
    def _muon(p, g, group, state) -> None:
        mu, lr = group["momentum"], group["lr"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        # Momentum b = mu*b + g and Nesterov g + mu*b, kept (like torch.optim.Muon and Keller Jordan's code) as
        # (1 - mu) times that: orthogonalise divides by the norm, so the scale is immaterial, and torch's
        # bf16 rounding, hence its step, is reproduced exactly.
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        o = orthogonalise(update, group["ns_steps"], getattr(torch, group["ns_dtype"]))
        p.mul_(1 - lr * group["weight_decay"])  # decoupled, with the unadjusted lr (as torch.optim.Muon)
        p.add_(o.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))

    @staticmethod
    def _adamw(p, g, group, state) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])  # bias-corrected second moment
        p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))


def split_named_params(named, adamw_names=ADAMW_NAME_HINTS) -> tuple[list, list]:
    """``(name, param)`` pairs split into ``(muon, adamw)`` tensor lists: Muon takes the trainable 2-D matrices
    with both sides > 1 (a [1, N] row is a vector to it) whose name mentions none of ``adamw_names``."""
    muon, adamw = [], []
    for name, p in named:
        hidden = p.requires_grad and p.ndim == 2 and min(p.shape) > 1
        (muon if hidden and not any(h in name.lower() for h in adamw_names) else adamw).append(p)
    return muon, adamw


def muon_adamw(params, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
               muon_lr: float | None = None, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
               muon_weight_decay: float | None = None, adjust_lr_fn: str | None = "match_rms_adamw",
               ns_dtype: str = "bfloat16", adamw_names=ADAMW_NAME_HINTS) -> MuonAdamW:
    """:class:`MuonAdamW` over ``params``: ``(name, param)`` pairs, or param groups of them. ``lr``, ``betas``,
    ``eps``, ``weight_decay`` are the AdamW part's (the project's AdamW settings as defaults).

    Defaults: ``muon_lr`` None is 10 x ``lr`` with ``adjust_lr_fn="match_rms_adamw"``, speculators' default
    pairing (its CLI; 0.02 is Keller Jordan's, for the "original" scale); ``muon_weight_decay`` None is
    ``weight_decay`` (Moonshot: with match_rms_adamw AdamW's decay carries over; speculators / torch use 0.1);
    ``momentum`` 0.95, ``nesterov``, ``ns_steps`` 5, bf16 Newton–Schulz as torch.optim.Muon and speculators.
    A caller's group keeps its own keys on its AdamW part; its ``lr``, relative to ``lr``, scales its Muon part
    alike (e.g. ConFu's ``confu_lr``)."""
    muon_lr = 10 * lr if muon_lr is None else muon_lr
    muon_wd = weight_decay if muon_weight_decay is None else muon_weight_decay
    adamw_names = tuple(str(h).lower() for h in adamw_names)
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        muon, adamw = split_named_params(group["params"], adamw_names)
        scale = group["lr"] / lr if "lr" in group else 1.0
        if muon:
            out.append({"params": muon, "use_muon": True, "lr": muon_lr * scale, "weight_decay": muon_wd})
        if adamw:
            out.append({**group, "params": adamw})
        log.info("muon_adamw: %d tensors (%d values) on Muon, %d on AdamW", len(muon),
                 sum(p.numel() for p in muon), len(adamw))
    # Plain Python types (not Hydra's ListConfig): the param groups are saved in checkpoints loaded weights_only.
    return MuonAdamW(out, lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay,
                     momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                     ns_dtype=str(ns_dtype))


muon_adamw.takes_named_params = True  # schedule.configure passes (name, param) pairs
