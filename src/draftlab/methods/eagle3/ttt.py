"""Training-time test (TTT) for EAGLE-3: the unrolled multi-step loss with EAGLE/SpecForge numerics.

Alignment (reference section 2.1/2.2). With target features ``F_t`` (context ``x_0..x_t``):

- step 0, row t consumes ``Emb(x_{t+1})`` and ``fc(F_t)`` and is trained on ``target_logits[t+1]``
  (the target's distribution of ``x_{t+2}``), weighted by ``loss_mask[t]`` (EAGLE/SpecForge do not shift
  the loss mask at step 0);
- step k, row t consumes the ground-truth ``Emb(x_{t+k+1})`` and the draft's own output state of step
  k-1 at the same row, is trained on ``target_logits[t+k+1]`` and weighted by ``loss_mask[t+k]``.
  Everything shifted past the end is zero-padded (and therefore masked).

Attention at step k ("prefix + diagonal", section 2.3): row t attends causally to the STEP-0 keys
``s <= t`` (minus padded keys) plus its own keys from steps 1..k; q/k of step k are rotated with
``position + k``. ``ttt_attention`` never builds the ``[T, (k+1)*T]`` mask: its implementations
(``draftlab.kernels.ttt_attention``: torch, blockwise, Triton, flex) score the k diagonal keys per row;
``naive_ttt_attention`` builds the explicit mask over concatenated keys and is the brute-force reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftlab.kernels.soft_cross_entropy import soft_cross_entropy
from draftlab.kernels.ttt_attention import resolve_impl
from draftlab.kernels.ttt_attention import ttt_attention as kernel_ttt_attention
from draftlab.methods.eagle3.model import causal_mask, masked_attention
from draftlab.training.losses import Loss, chain_weights, hard_confidence, position_losses

NORMALIZATIONS = ("batch_tokens", "mask_sum")


# ------------------------------------------------------------------------------------------------------
# attention


def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  attention_mask: torch.Tensor | None, scale: float, query_rows: torch.Tensor | None = None,
                  impl: str = "torch", window: int | None = None) -> torch.Tensor:
    """Prefix + diagonal attention of TTT step ``k = len(keys) - 1``.

    q [B, H, T, hd]; keys/values: per step 0..k, each [B, Hkv, T, hd]; attention_mask [B, T] (1 = real)
    or None -> [B, H, T, hd]. Row t attends to the step-0 keys ``s <= t`` and its own keys of steps 1..k.

    ``query_rows`` [M]: only these rows are unrolled (q and the keys/values of steps 1..k hold M rows, the
    step-0 keys all T): row m sees the step-0 keys ``s <= query_rows[m]`` and its own later keys. On-policy
    replay unrolls only the rows a verification round started from.

    ``impl``: ``torch`` (one ``[T, T]`` score block per step kept for backward), ``blockwise`` (online softmax,
    O(T) memory), ``triton``, ``flex`` or ``auto`` (see ``draftlab.kernels.ttt_attention``).
    ``window``: the draft's sliding window (``Eagle3Config.sliding_window``), passed to the kernel.
    """
    return kernel_ttt_attention(q, keys[0], values[0], keys[1:], values[1:], scale, rows=query_rows,
                                key_mask=attention_mask, impl=impl, window=window)


def ttt_attention_mask(T: int, num_steps: int, attention_mask: torch.Tensor | None = None, *,
                       device: torch.device | str | None = None, window: int | None = None) -> torch.Tensor:
    """Explicit TTT mask bool ``[B|1, T, num_steps * T]`` over keys concatenated step-major (0, 1, .., k).

    Block 0 is causal minus padded keys; blocks 1..k are the identity (a row sees its own later keys). A sliding
    ``window`` W (row t of step k at position t + k): block 0 keeps ``s > t + k - W``, block j only if ``k - j < W``.
    """
    k = num_steps - 1
    prefix = causal_mask(T, attention_mask, device=device, window=None if window is None else window - k)
    eye = torch.eye(T, dtype=torch.bool, device=prefix.device).expand(prefix.shape[0], T, T)
    later = [eye if window is None or k - j < window else torch.zeros_like(eye) for j in range(1, num_steps)]
    return torch.cat([prefix] + later, dim=-1)


def naive_ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        attention_mask: torch.Tensor | None, scale: float, window: int | None = None) -> torch.Tensor:
    """Brute-force reference for ``ttt_attention``: concatenated keys under ``ttt_attention_mask``."""
    k_all = torch.cat(list(keys), dim=2)  # [B, Hkv, (k+1)T, hd]
    v_all = torch.cat(list(values), dim=2)  # [B, Hkv, (k+1)T, hd]
    mask = ttt_attention_mask(q.shape[2], len(keys), attention_mask, device=q.device,
                              window=window)  # [B|1, T, (k+1)T]
    return masked_attention(q, k_all, v_all, mask, scale)


class TTTAttention:
    """``DraftAttention`` for the unrolled loop: every call of a layer is the next TTT step.

    Keeps each layer's rotated keys/values of all steps so far (autograd holds them anyway). ``impl`` is
    ``ttt_attention``'s (``auto``: Triton on CUDA, blockwise elsewhere), or ``naive`` for the brute-force
    reference. Setting ``query_rows`` [M] after step 0 unrolls only those rows in the later steps
    (``ttt_attention``'s ``query_rows``).
    """

    def __init__(self, attention_mask: torch.Tensor | None = None, *, impl: str = "auto"):
        if impl != "naive":
            resolve_impl(impl, "cpu")  # the name is checked here, the device when it runs
        self.attention_mask = attention_mask
        self.impl = impl
        self.query_rows: torch.Tensor | None = None
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    @property
    def naive(self) -> bool:
        return self.impl == "naive"

    @property
    def num_steps(self) -> int:
        return len(self.keys.get(0, []))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                 window: int | None = None) -> torch.Tensor:
        keys, values = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        keys.append(k)
        values.append(v)
        if self.naive and (self.query_rows is None or len(keys) == 1):
            return naive_ttt_attention(q, keys, values, self.attention_mask, scale, window)
        rows = self.query_rows if len(keys) > 1 else None
        return ttt_attention(q, keys, values, self.attention_mask, scale, rows, "torch" if self.naive else self.impl,
                             window)


# ------------------------------------------------------------------------------------------------------
# loss and metrics


@dataclass
class TTTOutput:
    """Weighted TTT loss and per-step statistics.

    ``per_step[k]`` holds 0-dim tensors (no host sync; only ``loss`` carries gradient):

    - ``loss``: step loss as normalised; ``loss_sum``/``loss_denom`` give it back and aggregate across batches;
    - ``acc`` = ``correct / count``; ``cond_acc`` = ``cond_correct / cond_count``;
      ``acceptance_rate`` = ``accept_sum / count``.
    Aggregate over batches by summing the numerators and denominators, never by averaging ratios.

    With ``p``, ``q``, ``pos_mask`` and ``lm_k`` as defined in ``ttt_forward``:

    - ``acc_k`` (EAGLE / SpecForge v0.2 definition): ``sum([argmax q == argmax p] * pos_mask) / sum(lm_k)``,
      i.e. the draft's greedy token equals the target's greedy token, out-of-draft-vocab targets count as
      misses, and the denominator is all loss-masked rows.
    - ``cond_acc_k``: the same, restricted to rows whose steps 0..k-1 were all correct (the chance that
      draft token k+1 is accepted given the first k were, under greedy verification).
    - ``acceptance_rate_k``: loss-masked mean over rows of ``sum_{v in draft vocab} min(p_full_v, q_v)``
      with ``p_full = softmax(z)`` over the full vocabulary (not renormalised). Since q puts no mass
      outside the draft vocabulary, this is ``1 - TV(p_full, q)``: the probability that a token sampled
      from q is accepted by speculative sampling at temperature 1 (teacher-forced context).
    """

    loss: torch.Tensor
    per_step: list[dict[str, torch.Tensor]]
    weights: list[float] = field(default_factory=list)

    def metric(self, name: str) -> list[float]:
        """Per-step values of ``name`` as Python floats (syncs with the device)."""
        return [float(s[name]) for s in self.per_step]


# out[:, t] = x[:, t + n], zeros past the end: EAGLE's ``padding(.., left=False)`` applied n times.
def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return x
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_forward(draft, input_ids: torch.Tensor, aux_hidden: torch.Tensor, target_logits: torch.Tensor,
                loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None, *, ttt_length: int = 7,
                step_weight: float = 0.8, normalization: str = "batch_tokens",
                position_ids: torch.Tensor | None = None, impl: str = "auto", cross_entropy: str = "auto",
                attention: TTTAttention | None = None, row_mask: torch.Tensor | None = None,
                loss: Loss | None = None) -> TTTOutput:
    """Unrolled EAGLE-3 training-time test over ``ttt_length`` steps.

    draft          an ``Eagle3Draft`` (anything with ``forward_step`` and ``d2t``/``t2d`` buffers).
    input_ids      [B, T] tokens x_0..x_{T-1}; aux_hidden [B, T, 3*d_t] target features F_t (unshifted).
    target_logits  [B, T, V] target logits at each position (row t = distribution of x_{t+1}; unshifted).
    loss_mask      [B, T] (1 = assistant token); attention_mask [B, T] (1 = real token) or None.
    step_weight    step k's loss is weighted by ``step_weight ** k`` (EAGLE/SpecForge 0.8; speculators 1.0).
    normalization  ``batch_tokens``: divide each step's summed loss by B*T (EAGLE/SpecForge, padding
                   included); ``mask_sum``: by that step's ``sum(lm_k)`` (speculators; defined below).
    position_ids   [B, T] RoPE positions of step 0 (default 0..T-1); step k uses ``position_ids + k``.
    impl           the attention of the default ``TTTAttention``: ``auto`` (Triton on CUDA, blockwise elsewhere),
                   ``torch``, ``blockwise``, ``triton``, ``flex``, or ``naive`` (brute force; references, benchmarks).
    cross_entropy  the soft-target cross-entropy (``draftlab.kernels.soft_cross_entropy``): ``auto`` (Triton on
                   CUDA, row chunks elsewhere: neither keeps the fp32 log-softmax for backward) or ``torch``.
    attention      a fresh ``TTTAttention`` (or subclass) to run the steps under, instead of the default
                   ``TTTAttention(attention_mask, impl=impl)``; methods with extra keys pass their own.
    row_mask       [B, T] optional per-row weight applied at EVERY step without shifting (row t stays
                   excluded at all steps), on top of ``lm_k`` below.
    loss           a ``draftlab.training.losses.Loss`` in place of the soft cross-entropy below (None: today's);
                   see ``_menu_loss`` for how its terms and weighting combine over the steps.

    Per step k (all sums over batch and rows), ``lm_k[t] = loss_mask[t + k] * attention_mask[t + k + 1]``:
    EAGLE's unshifted-then-shifted loss mask, and additionally zero where the target row t+k+1 is padding
    or past the end. The extra factor changes nothing when the last real token has loss_mask 0 (SpecForge
    forces that); otherwise it stops EAGLE's training on padded target logits.

    - ``p = softmax(z[draft ids])``: target logits restricted to the draft vocabulary (draft id i is
      target id ``i + d2t[i]``) and renormalised; ``q = softmax(draft logits)``.
    - ``pos_mask = t2d[argmax z] * lm_k``: rows whose full-vocabulary target argmax the draft cannot emit
      are dropped from the loss.
    - ``loss_k = -sum(pos_mask * sum_v p_v log q_v) / denom``; total ``sum_k step_weight**k * loss_k``.
    - per-step accuracies and acceptance rates: see ``TTTOutput``.
    """
    _check_inputs(draft, input_ids, aux_hidden, target_logits, loss_mask, normalization, ttt_length)
    B, T = input_ids.shape
    device = input_ids.device
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    if position_ids is None:
        position_ids = torch.arange(T, device=device).expand(B, T)
    loss_mask = loss_mask.to(device=device, dtype=torch.float32)
    # A row can only be trained when its target position exists and is a real token.
    has_target_all = (attention_mask.float() if attention_mask is not None
                      else torch.ones(B, T, device=device))  # [B, T]
    row_weight = row_mask.to(device=device, dtype=torch.float32) if row_mask is not None else None  # [B, T]
    tgt = _TargetSide.of(draft, target_logits)

    denom_bt = torch.tensor(float(B * T), device=device)
    attention = attention if attention is not None else TTTAttention(attention_mask, impl=impl)
    hidden = aux_hidden  # 3*d_t at step 0 (forward_step runs fc), the draft's own d-dim state afterwards
    prev_correct = torch.ones(B, T, dtype=torch.bool, device=device)
    total = None
    menu: list[tuple] = []  # per step (ell, pos_mask, labels, logits) when a loss menu entry is chosen
    per_step: list[dict[str, torch.Tensor]] = []
    weights = [step_weight ** k for k in range(ttt_length)]
    for k in range(ttt_length):
        ids_k = _shift_left(input_ids, k + 1)  # [B, T] row t consumes x_{t+k+1}
        hidden, logits = draft.forward_step(ids_k, hidden, position_ids + k, attention)  # [B, T, d], [B, T, V_d]
        p = _shift_left(tgt.p, k + 1)  # [B, T, V_d] row t targets x_{t+k+2}
        lm = _shift_left(loss_mask, k) * _shift_left(has_target_all, k + 1)  # [B, T]
        lm = lm if row_weight is None else lm * row_weight
        pos_mask = lm * _shift_left(tgt.in_draft, k + 1)  # [B, T]
        ce = _row_losses(loss, logits, p, tgt, k, cross_entropy, pos_mask, menu)  # [B, T]
        loss_sum = (ce * pos_mask).sum()
        denom = denom_bt if normalization == "batch_tokens" else lm.sum().clamp_min(1.0)
        loss_k = loss_sum / denom
        total = weights[k] * loss_k if total is None else total + weights[k] * loss_k
        stats, prev_correct = _step_metrics(tgt, k, logits.detach(), lm, prev_correct)
        per_step.append(dict(loss=loss_k, loss_sum=loss_sum.detach(), loss_denom=denom.detach().float(), **stats))
    if loss is not None and loss.weighting != "method":
        total = _menu_loss(loss, menu, weights)
    return TTTOutput(loss=total, per_step=per_step, weights=weights)


def _row_losses(loss: Loss | None, logits: torch.Tensor, p: torch.Tensor, tgt: _TargetSide, k: int,
                cross_entropy: str, pos_mask: torch.Tensor, menu: list) -> torch.Tensor:
    """Step k's row losses [B, T]: the soft cross-entropy, or the menu's terms (hard label: the target's greedy
    token in draft ids), whose per-step pieces are kept in ``menu`` for ``_menu_loss``."""
    if loss is None:
        return _soft_ce(logits, p, cross_entropy)
    labels = _shift_left(tgt.argmax, k + 1)  # [B, T]
    ell = position_losses(loss, logits, p, labels)
    menu.append((ell, pos_mask, labels, logits))
    return ell


def _menu_loss(loss: Loss, steps: list, step_weights: list[float]) -> torch.Tensor:
    """The loss over all steps under a weighting other than the method's (which keeps TTT's sum of per-step
    means above): the positions of row t's chain are its steps k = 0..K-1, and the loss is the weighted mean
    ``sum w ell / sum w`` over rows and steps (``uniform``: w = 1; ``dpace``: D-PACE along each row's steps,
    the draft's confidence in the target's greedy token)."""
    ell = torch.stack([s[0] for s in steps], -1)  # [B, T, K]
    valid = torch.stack([s[1] for s in steps], -1) > 0  # [B, T, K]
    method = torch.tensor(step_weights, device=ell.device)  # [K]

    def confidence() -> torch.Tensor:
        return torch.stack([hard_confidence(s[3].detach(), s[2]) for s in steps], -1)  # [B, T, K]

    w = chain_weights(loss, method, valid, confidence)  # [B, T, K]
    return (w * ell).sum() / w.sum().clamp_min(1e-12)


def _check_inputs(draft, input_ids: torch.Tensor, aux_hidden: torch.Tensor, target_logits: torch.Tensor,
                  loss_mask: torch.Tensor, normalization: str, ttt_length: int) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got '{normalization}'")
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    B, T = input_ids.shape
    if aux_hidden.shape[:2] != (B, T) or target_logits.shape[:2] != (B, T) or loss_mask.shape != (B, T):
        raise ValueError(f"shape mismatch: input_ids {tuple(input_ids.shape)}, aux_hidden {tuple(aux_hidden.shape)}, "
                         f"target_logits {tuple(target_logits.shape)}, loss_mask {tuple(loss_mask.shape)}")
    if target_logits.shape[-1] != draft.t2d.numel():
        raise ValueError(f"target_logits have V={target_logits.shape[-1]} but the draft's t2d has {draft.t2d.numel()}")


@dataclass
class _TargetSide:
    """What every TTT step needs from the (unshifted) target logits ``z``, computed once without grad."""

    p: torch.Tensor  # [B, T, V_d] softmax of z restricted to the draft vocabulary, renormalised
    p_full: torch.Tensor  # [B, T, V_d] full-vocabulary softmax mass of the draft-vocabulary tokens
    in_draft: torch.Tensor  # [B, T] 1 where the target's full-vocabulary argmax is a draft token
    argmax: torch.Tensor  # [B, T] draft id of the target's draft-vocabulary argmax

    # Rows per chunk: about 2^26 elements of the full vocabulary in fp32 at a time (256 MiB), whatever B x T is.
    CHUNK_ELEMENTS = 1 << 26

    @classmethod
    @torch.no_grad()
    def of(cls, draft, target_logits: torch.Tensor, chunk_rows: int | None = None) -> _TargetSide:
        """Row by row, so the only full-vocabulary tensors are the target's own logits and one chunk of rows in
        fp32 (never ``[B, T, V]`` in fp32 and its temporaries): every quantity is a function of its row."""
        B, T, V = target_logits.shape
        dtype = torch.promote_types(target_logits.dtype, torch.float32)
        device = target_logits.device
        draft_ids = (draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)).to(device)  # [V_d]
        t2d = draft.t2d.to(device)  # [V]
        rows = target_logits.reshape(B * T, V)  # [N, V] (a view)
        n, v_d = rows.shape[0], draft_ids.numel()
        p = torch.empty(n, v_d, dtype=dtype, device=device)  # [N, V_d]
        p_full = torch.empty_like(p)  # [N, V_d]
        in_draft = torch.empty(n, dtype=torch.float32, device=device)  # [N]
        argmax = torch.empty(n, dtype=torch.long, device=device)  # [N]
        step = chunk_rows or max(1, cls.CHUNK_ELEMENTS // max(V, 1))
        for s in range(0, n, step):
            z = rows[s:s + step].to(dtype)  # [c, V]
            z_d = z.index_select(-1, draft_ids)  # [c, V_d]
            p[s:s + step] = torch.exp(z_d - torch.logsumexp(z_d, dim=-1, keepdim=True))
            p_full[s:s + step] = torch.exp(z_d - torch.logsumexp(z, dim=-1, keepdim=True))
            in_draft[s:s + step] = t2d[z.argmax(-1)].float()
            argmax[s:s + step] = z_d.argmax(-1)
        return cls(p=p.view(B, T, v_d), p_full=p_full.view(B, T, v_d), in_draft=in_draft.view(B, T),
                   argmax=argmax.view(B, T))


def _soft_ce(logits: torch.Tensor, p: torch.Tensor, impl: str) -> torch.Tensor:
    """``-(p * log_softmax(logits)).sum(-1)`` [B, T]; fp64 logits (parity tests) keep the plain torch form in fp64,
    the fused paths compute in fp32."""
    if impl == "torch" or logits.dtype == torch.float64:
        logq = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [B, T, V_d]
        return -(p * logq).sum(-1)
    return soft_cross_entropy(logits, p, impl=impl)


@torch.no_grad()
def _step_metrics(tgt: _TargetSide, k: int, logits: torch.Tensor, lm: torch.Tensor, prev_correct: torch.Tensor
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Step k's accuracy counters (see ``TTTOutput``) and the rows whose steps 0..k were all correct."""
    logq = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [B, T, V_d], no grad
    # The draft's greedy token is the target's greedy token (impossible when the latter is outside
    # the draft vocabulary). Judged independently of the loss mask, so that a chain crossing a
    # masked token is still conditioned on what the draft actually predicted there.
    match = (logq.argmax(-1) == _shift_left(tgt.argmax, k + 1)) & (_shift_left(tgt.in_draft, k + 1) > 0)
    count = lm.sum()
    n_correct = (match.float() * lm).sum()  # == sum([argmax q == argmax p] * pos_mask)
    cond_rows = (lm > 0) & prev_correct  # [B, T]
    cond_count = cond_rows.sum().float()
    cond_correct = (match & cond_rows).sum().float()
    accept = torch.minimum(_shift_left(tgt.p_full, k + 1), logq.exp()).sum(-1)  # [B, T]
    accept_sum = (accept * lm).sum()
    stats = dict(
        acc=n_correct / count.clamp_min(1.0), correct=n_correct, count=count,
        cond_acc=cond_correct / cond_count.clamp_min(1.0), cond_correct=cond_correct, cond_count=cond_count,
        acceptance_rate=accept_sum / count.clamp_min(1.0), accept_sum=accept_sum,
    )
    return stats, prev_correct & match
