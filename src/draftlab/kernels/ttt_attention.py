"""TTT attention, "prefix + diagonal": one unrolled training-time-test step of an EAGLE-3 draft layer.

At TTT step k, query row m (the draft's row at prefix position ``rows[m]``) attends to the step-0 keys
``s <= rows[m]`` that are real tokens, plus its own keys of steps 1..k, under one softmax. Four
implementations of the same op, selected by ``impl``:

- ``torch``: the reference. The prefix scores are one matmul under a causal mask, the k diagonal scores
  elementwise products; autograd keeps the ``[B, H, M, T]`` fp32 probabilities for backward.
- ``blockwise``: the same op in key and query blocks with an online softmax; forward keeps only the output
  and the per-row log-sum-exp, backward recomputes each block's probabilities. Peak memory is O(T) per
  step instead of O(T^2): the CPU path for long sequences.
- ``triton``: the blockwise algorithm as Triton kernels (forward, and backward as one kernel for dq and the
  diagonal grads plus one for the prefix dk/dv), for CUDA; tested on CPU under ``TRITON_INTERPRET=1``.
- ``flex``: ``torch.nn.attention.flex_attention`` with the TTT mask over the concatenated keys (fused when
  compiled; its eager fallback materialises the scores).

``auto`` is ``triton`` on CUDA when Triton is installed, else ``blockwise``.

Layout (hd = head dim, heads ``h = kv * G + g`` share KV head ``kv``):
  q               [B, H, M, hd]        queries of the unrolled rows
  k0, v0          [B, Hkv, T, hd]      step-0 keys / values (the prefix)
  diag_k, diag_v  k tensors [B, Hkv, M, hd]: the rows' own keys / values of steps 1..k (k may be 0)
  rows            [M] int or None      prefix position of each query row (None: ``arange(T)``, M == T)
  key_mask        [B, T] bool or None  False = padded key, never attended
  window          int or None          sliding window W: the row of step k stands at index ``rows[m] + k`` and
                                       sees step-0 keys ``s > rows[m] + k - W`` and its step-j keys for ``j > k - W``
-> [B, H, M, hd]

A row that can see no key (a padded first row at step 0) gets a zero output and zero gradients. The window is
implemented by ``torch``, ``blockwise`` and ``flex``; ``auto`` picks ``blockwise`` for it, ``triton`` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from draftlab.kernels._triton import available as triton_available
from draftlab.kernels._triton import interpreting, tl, triton
from draftlab.kernels._triton import require as require_triton
from draftlab.kernels.ttt_flex import flex_ttt
from draftlab.kernels.ttt_window import key_blocks, visible_steps, windowed_impl

IMPLS = ("torch", "blockwise", "triton", "flex")
BLOCK = 512  # blockwise: rows and keys per block (about B*H*512*512 fp32 scores live at once)


# The compute dtypes the Triton kernels are tested in (tests/kernels: fp32 and fp64 against the reference,
# bf16 and fp16 against it run in fp32); ``auto`` picks Triton only for these.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_impl(impl: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """``auto`` -> ``triton`` on CUDA with Triton installed and a tested compute ``dtype`` (``compute_dtype``;
    None: any), else ``blockwise``; any other name is checked."""
    if impl == "auto":
        tested = dtype is None or dtype in TRITON_DTYPES
        return "triton" if str(device).startswith("cuda") and triton_available(device) and tested else "blockwise"
    if impl not in IMPLS:
        raise ValueError(f"TTT attention must be one of auto, {', '.join(IMPLS)}; got '{impl}'")
    return impl


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype a fused kernel call computes in: autocast's dtype where autocast is on for the tensors'
    device (what the matmuls around it run in), else the promotion of the inputs' dtypes. Under bf16-mixed
    training an fp32 draft's rotary tables make q and k fp32 while v stays bf16: one kernel call must not see
    both (Triton's dot products need one dtype)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: Sequence[torch.Tensor],
                  diag_v: Sequence[torch.Tensor], scale: float, *, rows: torch.Tensor | None = None,
                  key_mask: torch.Tensor | None = None, impl: str = "auto", block: int | None = None,
                  window: int | None = None) -> torch.Tensor:
    """Prefix + diagonal attention of one TTT step (layout in the module docstring).

    ``blockwise`` and ``triton`` run with autocast off, forward and backward alike, each in one dtype:
    blockwise in fp32 (fp64 for fp64 inputs) whatever its inputs; Triton in ``compute_dtype`` (its inputs cast
    to it, the gradients cast back to each input's dtype). Under autocast the forward would otherwise run its
    matmuls in bf16 and the backward recompute them in fp32, so p would no longer match the saved lse."""
    ct = compute_dtype(q, k0, v0, *diag_k, *diag_v)
    if impl == "auto" and window is not None:
        impl = "blockwise"  # windowed on every device (kernels/ttt_window.py)
    impl = windowed_impl(resolve_impl(impl, q.device, ct), window)
    B, H, M, hd = q.shape
    T = k0.shape[2]
    if rows is None and M != T:
        raise ValueError(f"{M} query rows but {T} prefix keys: pass rows (each query row's prefix position)")
    if key_mask is not None:
        key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    if impl == "torch":
        return reference(q, k0, v0, diag_k, diag_v, scale, rows=rows, key_mask=key_mask, window=window)
    positions = rows is None  # rows[m] == m: lets the kernels skip key blocks after a query block
    rows = torch.arange(T, device=q.device) if rows is None else rows.to(q.device)
    dk = _stack(diag_k, k0, M)  # [B, Hkv, k, M, hd]
    dv = _stack(diag_v, v0, M)  # [B, Hkv, k, M, hd]
    if impl == "flex":
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise RuntimeError("flex_attention has no CPU backward in this torch: train with attention: blockwise "
                               "on CPU (flex runs forward-only there)")
        return flex_ttt(q, k0, v0, dk, dv, scale, rows, key_mask, window)
    with torch.autocast(q.device.type, enabled=False):
        if impl == "triton":
            require_triton(q.device)
            if block is not None and block < 16:
                raise ValueError(f"Triton's dot products need blocks of at least 16 rows, got block={block}")
            q, k0, v0, dk, dv = (t.to(ct) for t in (q, k0, v0, dk, dv))  # autograd casts each grad back
            return _TritonTTT.apply(q, k0, v0, dk, dv, rows, key_mask, scale, positions, block)
        return _Blockwise.apply(q, k0, v0, dk, dv, rows, key_mask, scale, block or BLOCK, window)


def _stack(diag: Sequence[torch.Tensor], like: torch.Tensor, M: int) -> torch.Tensor:
    if len(diag):
        return torch.stack(list(diag), dim=2)
    B, Hkv, _, hd = like.shape
    return like.new_zeros(B, Hkv, 0, M, hd)


def prefix_mask(rows: torch.Tensor, key_mask: torch.Tensor | None, lo: int, hi: int, window: int | None = None,
                n_diag: int = 0) -> torch.Tensor:
    """bool ``[B|1, M, hi - lo]``: query row m (of step ``n_diag``) may see prefix key s in [lo, hi)."""
    s = torch.arange(lo, hi, device=rows.device)  # [n]
    mask = (s[None, :] <= rows[:, None])[None]  # [1, M, n]
    if window is not None:
        mask = mask & (s[None, :] > rows[:, None] + n_diag - window)[None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, lo:hi]  # [B, M, n]
    return mask


# ------------------------------------------------------------------------------------------------------
# torch reference


def reference(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: Sequence[torch.Tensor],
              diag_v: Sequence[torch.Tensor], scale: float, *, rows: torch.Tensor | None = None,
              key_mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """The op in plain torch: prefix scores are one ``[M, T]`` matmul under the causal + padding (+ window) mask,
    the k diagonal scores ``(q * k_i).sum(-1)``, so no ``[M, (k+1)T]`` score block or mask exists."""
    B, H, M, hd = q.shape
    Hkv, T = k0.shape[1], k0.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, M, hd)
    prefix = torch.matmul(q.reshape(B, Hkv, G * M, hd), k0.transpose(-1, -2)).view(B, Hkv, G, M, T)
    ct = torch.promote_types(prefix.dtype, torch.float32)
    prefix = prefix.to(ct) * scale  # [B, Hkv, G, M, T]
    rows = torch.arange(T, device=q.device) if rows is None else rows.to(q.device)
    mask = prefix_mask(rows, key_mask, 0, T, window, len(diag_k))  # [B|1, M, T]
    # The dtype's minimum, not -inf: a row with no visible key gets finite (ignored) values, never NaN.
    prefix = prefix.masked_fill(~mask[:, None, None], torch.finfo(ct).min)
    if len(diag_k):
        diag = torch.stack([(qg * k_i[:, :, None]).sum(-1) for k_i in diag_k], dim=-1)  # [B, Hkv, G, M, k]
        diag = diag.to(ct) * scale
        hidden = visible_steps(len(diag_k), window).start  # the earliest steps, fallen out of the window
        if hidden:
            diag[..., :hidden] = torch.finfo(ct).min
        scores = torch.cat([prefix, diag], dim=-1)  # [B, Hkv, G, M, T + k]
    else:
        scores = prefix
    probs = torch.softmax(scores, dim=-1).to(v0.dtype)  # [B, Hkv, G, M, T + k]
    out = torch.matmul(probs[..., :T].reshape(B, Hkv, G * M, T), v0).view(B, Hkv, G, M, hd)
    for i, v_i in enumerate(diag_v):
        out = out + probs[..., T + i, None] * v_i[:, :, None]  # [B, Hkv, G, M, hd]
    return out.reshape(B, H, M, hd)


# ------------------------------------------------------------------------------------------------------
# blockwise torch (online softmax forward, recompute backward)


def _online(m_i, l_i, acc, s, pv):
    """Fold scores ``s [..., n]`` into the running max / sum / output; ``pv(p)`` is ``p``'s weighted values."""
    m_new = torch.maximum(m_i, s.amax(-1))  # [...]
    m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # all masked so far: keep exp() finite
    alpha = torch.exp(m_i - m_safe)
    p = torch.exp(s - m_safe[..., None])  # masked scores (-inf) -> 0
    return m_new, l_i * alpha + p.sum(-1), acc * alpha[..., None] + pv(p)


class _Blockwise(torch.autograd.Function):
    """Blockwise TTT attention in fp32 (fp64 for fp64 inputs); saves the inputs, the output and the lse."""

    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, rows, key_mask, scale, block, window):
        B, H, M, hd = q.shape
        Hkv, T, n_diag = k0.shape[1], k0.shape[2], dk.shape[2]
        G = H // Hkv
        ct = torch.promote_types(q.dtype, torch.float32)
        qg = q.reshape(B, Hkv, G, M, hd)
        out = torch.empty(B, Hkv, G, M, hd, dtype=ct, device=q.device)
        lse = torch.empty(B, Hkv, G, M, dtype=ct, device=q.device)
        for m0 in range(0, M, block):
            m1 = min(M, m0 + block)
            qb, rb = qg[:, :, :, m0:m1].to(ct), rows[m0:m1]  # [B, Hkv, G, bm, hd], [bm]
            m_i = torch.full(qb.shape[:-1], -math.inf, dtype=ct, device=q.device)  # [B, Hkv, G, bm]
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros_like(qb)  # [B, Hkv, G, bm, hd]
            for n0 in key_blocks(rb, T, block, window, n_diag):
                n1 = min(T, n0 + block)
                kb, vb = k0[:, :, None, n0:n1].to(ct), v0[:, :, None, n0:n1].to(ct)  # [B, Hkv, 1, bn, hd]
                s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [B, Hkv, G, bm, bn]
                s = s.masked_fill(~prefix_mask(rb, key_mask, n0, n1, window, n_diag)[:, None, None], -math.inf)
                m_i, l_i, acc = _online(m_i, l_i, acc, s, lambda p, vb=vb: torch.matmul(p, vb))
            for i in visible_steps(n_diag, window):
                kd = dk[:, :, None, i, m0:m1].to(ct)  # [B, Hkv, 1, bm, hd]
                vd = dv[:, :, None, i, m0:m1].to(ct)
                s = (qb * kd).sum(-1, keepdim=True) * scale  # [B, Hkv, G, bm, 1]
                m_i, l_i, acc = _online(m_i, l_i, acc, s, lambda p, vd=vd: p * vd)
            empty = l_i == 0  # no visible key: output 0, and lse +inf makes every recomputed p 0
            out[:, :, :, m0:m1] = acc / l_i.masked_fill(empty, 1.0)[..., None]
            m_safe = m_i.masked_fill(m_i == -math.inf, 0.0)
            lse[:, :, :, m0:m1] = (m_safe + torch.log(l_i)).masked_fill(empty, math.inf)
        ctx.save_for_backward(q, k0, v0, dk, dv, rows, key_mask, out, lse)
        ctx.scale, ctx.block, ctx.window = scale, block, window
        return out.to(q.dtype).reshape(B, H, M, hd)

    @staticmethod
    def backward(ctx, grad_out):
        # The recomputation runs as the forward did: autocast off (a backward under autocast would run its
        # matmuls in bf16 while the saved lse came from fp32 ones).
        with torch.autocast(grad_out.device.type, enabled=False):
            q, k0, v0, dk, dv, rows, key_mask, out, lse = ctx.saved_tensors
            scale, block, window = ctx.scale, ctx.block, ctx.window
            B, H, M, hd = q.shape
            Hkv, T, n_diag = k0.shape[1], k0.shape[2], dk.shape[2]
            G = H // Hkv
            ct = out.dtype
            qg = q.reshape(B, Hkv, G, M, hd)
            do = grad_out.reshape(B, Hkv, G, M, hd).to(ct)  # [B, Hkv, G, M, hd]
            delta = (do * out).sum(-1)  # [B, Hkv, G, M]: sum_j p_j dp_j, the softmax backward's row term
            g_q = torch.zeros(B, Hkv, G, M, hd, dtype=ct, device=q.device)
            g_k0 = torch.zeros(B, Hkv, T, hd, dtype=ct, device=q.device)
            g_v0 = torch.zeros_like(g_k0)
            g_dk = torch.zeros(dk.shape, dtype=ct, device=q.device)  # [B, Hkv, k, M, hd]
            g_dv = torch.zeros_like(g_dk)
            for m0 in range(0, M, block):
                m1 = min(M, m0 + block)
                qb, rb = qg[:, :, :, m0:m1].to(ct), rows[m0:m1]  # [B, Hkv, G, bm, hd]
                dob, lb, db = do[:, :, :, m0:m1], lse[:, :, :, m0:m1, None], delta[:, :, :, m0:m1, None]
                for n0 in key_blocks(rb, T, block, window, n_diag):
                    n1 = min(T, n0 + block)
                    kb, vb = k0[:, :, None, n0:n1].to(ct), v0[:, :, None, n0:n1].to(ct)  # [B, Hkv, 1, bn, hd]
                    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [B, Hkv, G, bm, bn]
                    s = s.masked_fill(~prefix_mask(rb, key_mask, n0, n1, window, n_diag)[:, None, None], -math.inf)
                    p = torch.exp(s - lb)  # the forward's probabilities, recomputed
                    g_v0[:, :, n0:n1] += torch.matmul(p.transpose(-1, -2), dob).sum(2)  # [B, Hkv, bn, hd]
                    ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - db)  # [B, Hkv, G, bm, bn]
                    g_q[:, :, :, m0:m1] += torch.matmul(ds, kb) * scale
                    g_k0[:, :, n0:n1] += torch.matmul(ds.transpose(-1, -2), qb).sum(2) * scale
                for i in visible_steps(n_diag, window):
                    kd = dk[:, :, None, i, m0:m1].to(ct)  # [B, Hkv, 1, bm, hd]
                    vd = dv[:, :, None, i, m0:m1].to(ct)
                    p = torch.exp((qb * kd).sum(-1, keepdim=True) * scale - lb)  # [B, Hkv, G, bm, 1]
                    g_dv[:, :, i, m0:m1] += (p * dob).sum(2)
                    ds = p * ((dob * vd).sum(-1, keepdim=True) - db)  # [B, Hkv, G, bm, 1]
                    g_q[:, :, :, m0:m1] += ds * kd * scale
                    g_dk[:, :, i, m0:m1] += (ds * qb).sum(2) * scale
            return (g_q.reshape(B, H, M, hd).to(q.dtype), g_k0.to(k0.dtype), g_v0.to(v0.dtype), g_dk.to(dk.dtype),
                    g_dv.to(dv.dtype), None, None, None, None, None)


# ------------------------------------------------------------------------------------------------------
# Triton


def _widen_dots(q: torch.Tensor) -> bool:
    return q.dtype == torch.bfloat16 and interpreting()


class _TritonTTT(torch.autograd.Function):
    """The blockwise algorithm as Triton kernels; fp32 accumulation, IEEE fp32 dot products for fp32 inputs."""

    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, rows, key_mask, scale, positions, block):
        B, H, M, hd = q.shape
        Hkv, T, n_diag = k0.shape[1], k0.shape[2], dk.shape[2]
        q, k0, v0, dk, dv = (t.contiguous() for t in (q, k0, v0, dk, dv))
        rows = rows.to(torch.int32).contiguous()
        km = key_mask.to(torch.int8).contiguous() if key_mask is not None else rows  # dummy pointer when absent
        bm = bn = block or (16 if q.device.type == "cpu" else 64)
        bd = max(16, triton.next_power_of_2(hd))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, M, dtype=torch.float32, device=q.device)
        _ttt_fwd[(triton.cdiv(M, bm), B * H)](
            q, k0, v0, dk, dv, rows, km, out, lse, scale, H, Hkv, M, T, n_diag,
            HD=hd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, HAS_MASK=key_mask is not None,
            PREC="ieee" if q.dtype == torch.float32 else None, F32=_widen_dots(q))
        ctx.save_for_backward(q, k0, v0, dk, dv, rows, km, out, lse)
        ctx.meta = (scale, positions, key_mask is not None, bm, bn, bd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, dk, dv, rows, km, out, lse = ctx.saved_tensors
        scale, positions, has_mask, bm, bn, bd = ctx.meta
        B, H, M, hd = q.shape
        Hkv, T, n_diag = k0.shape[1], k0.shape[2], dk.shape[2]
        G = H // Hkv
        do = grad_out.to(q.dtype).contiguous()  # the compute dtype: one dtype in every dot product
        delta = (do.float() * out.float()).sum(-1).contiguous()  # [B, H, M]
        prec = "ieee" if q.dtype == torch.float32 else None
        g_q = torch.empty(B, H, M, hd, dtype=torch.float32, device=q.device)
        # per query head; summed over each KV head's group below
        g_dk = torch.empty(B, H, n_diag, M, hd, dtype=torch.float32, device=q.device)
        g_dv = torch.empty_like(g_dk)
        _ttt_bwd_rows[(triton.cdiv(M, bm), B * H)](
            q, k0, v0, dk, dv, rows, km, do, lse, delta, g_q, g_dk, g_dv, scale, H, Hkv, M, T, n_diag,
            HD=hd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, HAS_MASK=has_mask, PREC=prec, F32=_widen_dots(q))
        g_k0 = torch.empty(B, Hkv, T, hd, dtype=torch.float32, device=q.device)
        g_v0 = torch.empty_like(g_k0)
        _ttt_bwd_prefix[(triton.cdiv(T, bn), B * Hkv)](
            q, k0, v0, rows, km, do, lse, delta, g_k0, g_v0, scale, H, Hkv, M, T,
            HD=hd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, HAS_MASK=has_mask, POSITIONS=positions, PREC=prec,
            F32=_widen_dots(q))
        g_dk = g_dk.view(B, Hkv, G, n_diag, M, hd).sum(2)
        g_dv = g_dv.view(B, Hkv, G, n_diag, M, hd).sum(2)
        return (g_q.to(q.dtype), g_k0.to(k0.dtype), g_v0.to(v0.dtype), g_dk.to(dk.dtype), g_dv.to(dv.dtype),
                None, None, None, None, None)


if triton is not None:

    @triton.jit
    def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
        # Triton's CPU interpreter multiplies bf16 tiles wrongly; there the tiles (already rounded to their
        # dtype) are widened first, which is what a bf16 tensor-core product with fp32 accumulation computes.
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=PREC)

    @triton.jit
    def _ttt_fwd(Q, K0, V0, DK, DV, ROWS, KMASK, OUT, LSE, scale, H, HKV, M, T, NDIAG,
                 HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_MASK: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)  # b * H + h
        b = bh // H
        kv = b * HKV + (bh % H) // (H // HKV)  # b * HKV + the head's KV head
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < M
        d_ok = offs_d < HD
        md_ok = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + (bh * M + offs_m[:, None]) * HD + offs_d[None, :], mask=md_ok, other=0.0)  # [BM, BD]
        rows = tl.load(ROWS + offs_m, mask=m_ok, other=-1)  # [BM]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, tl.max(rows, 0) + 1, BLOCK_N):  # keys after the block's last row are never seen
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            nd_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K0 + (kv * T + offs_n[:, None]) * HD + offs_d[None, :], mask=nd_ok, other=0.0)  # [BN, BD]
            s = _dot(q, tl.trans(k), PREC, F32) * scale  # [BM, BN]
            ok = (offs_n[None, :] <= rows[:, None]) & n_ok[None, :]
            if HAS_MASK:
                ok = ok & (tl.load(KMASK + b * T + offs_n, mask=n_ok, other=0) != 0)[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(V0 + (kv * T + offs_n[:, None]) * HD + offs_d[None, :], mask=nd_ok, other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, F32)
            m_i = m_new
        for i in range(NDIAG):  # the row's own keys of steps 1..k, one score per row
            at = ((kv * NDIAG + i) * M + offs_m[:, None]) * HD + offs_d[None, :]
            kd = tl.load(DK + at, mask=md_ok, other=0.0).to(tl.float32)
            s = tl.sum(q.to(tl.float32) * kd, 1) * scale  # [BM]
            s = tl.where(m_ok, s, float("-inf"))
            m_new = tl.maximum(m_i, s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe)
            vd = tl.load(DV + at, mask=md_ok, other=0.0).to(tl.float32)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vd
            m_i = m_new
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        tl.store(OUT + (bh * M + offs_m[:, None]) * HD + offs_d[None, :], (acc / l_safe[:, None]).to(OUT.dtype.element_ty),
                 mask=md_ok)
        tl.store(LSE + bh * M + offs_m, tl.where(empty, float("inf"), m_fin + tl.log(l_safe)), mask=m_ok)

    @triton.jit
    def _ttt_bwd_rows(Q, K0, V0, DK, DV, ROWS, KMASK, DO, LSE, DELTA, GQ, GDK, GDV, scale, H, HKV, M, T, NDIAG,
                      HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_MASK: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr):
        """dq of a block of query rows, and the per-head grads of their diagonal keys / values."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        kv = b * HKV + (bh % H) // (H // HKV)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < M
        d_ok = offs_d < HD
        md_ok = m_ok[:, None] & d_ok[None, :]
        at_q = (bh * M + offs_m[:, None]) * HD + offs_d[None, :]
        q = tl.load(Q + at_q, mask=md_ok, other=0.0)  # [BM, BD]
        do = tl.load(DO + at_q, mask=md_ok, other=0.0)
        rows = tl.load(ROWS + offs_m, mask=m_ok, other=-1)
        lse = tl.load(LSE + bh * M + offs_m, mask=m_ok, other=float("inf"))  # [BM]
        delta = tl.load(DELTA + bh * M + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, tl.max(rows, 0) + 1, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            nd_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K0 + (kv * T + offs_n[:, None]) * HD + offs_d[None, :], mask=nd_ok, other=0.0)
            v = tl.load(V0 + (kv * T + offs_n[:, None]) * HD + offs_d[None, :], mask=nd_ok, other=0.0)
            s = _dot(q, tl.trans(k), PREC, F32) * scale  # [BM, BN]
            ok = (offs_n[None, :] <= rows[:, None]) & n_ok[None, :]
            if HAS_MASK:
                ok = ok & (tl.load(KMASK + b * T + offs_n, mask=n_ok, other=0) != 0)[None, :]
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)  # the forward's probabilities
            dp = _dot(do, tl.trans(v), PREC, F32)  # [BM, BN]
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PREC, F32) * scale
        qf = q.to(tl.float32)
        dof = do.to(tl.float32)
        for i in range(NDIAG):
            at = ((kv * NDIAG + i) * M + offs_m[:, None]) * HD + offs_d[None, :]
            kd = tl.load(DK + at, mask=md_ok, other=0.0).to(tl.float32)
            vd = tl.load(DV + at, mask=md_ok, other=0.0).to(tl.float32)
            p = tl.where(m_ok, tl.exp(tl.sum(qf * kd, 1) * scale - lse), 0.0)  # [BM]
            ds = p * (tl.sum(dof * vd, 1) - delta)
            dq += ds[:, None] * kd * scale
            at_h = ((bh * NDIAG + i) * M + offs_m[:, None]) * HD + offs_d[None, :]
            tl.store(GDK + at_h, ds[:, None] * qf * scale, mask=md_ok)
            tl.store(GDV + at_h, p[:, None] * dof, mask=md_ok)
        tl.store(GQ + at_q, dq, mask=md_ok)

    @triton.jit
    def _ttt_bwd_prefix(Q, K0, V0, ROWS, KMASK, DO, LSE, DELTA, GK, GV, scale, H, HKV, M, T,
                        HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_MASK: tl.constexpr, POSITIONS: tl.constexpr, PREC: tl.constexpr,
                        F32: tl.constexpr):
        """dk / dv of a block of prefix keys, summed over the query heads that share their KV head."""
        pid_n = tl.program_id(0)
        kv = tl.program_id(1).to(tl.int64)  # b * HKV + kv head
        b = kv // HKV
        G = H // HKV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        n_ok = offs_n < T
        d_ok = offs_d < HD
        nd_ok = n_ok[:, None] & d_ok[None, :]
        at_k = (kv * T + offs_n[:, None]) * HD + offs_d[None, :]
        k = tl.load(K0 + at_k, mask=nd_ok, other=0.0)  # [BN, BD]
        v = tl.load(V0 + at_k, mask=nd_ok, other=0.0)
        key_ok = n_ok
        if HAS_MASK:
            key_ok = key_ok & (tl.load(KMASK + b * T + offs_n, mask=n_ok, other=0) != 0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # With rows[m] == m no query row before this key block sees it.
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if POSITIONS else 0
        for g in range(G):
            bh = b * H + (kv % HKV) * G + g
            for m0 in range(lo, M, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_ok = offs_m < M
                md_ok = m_ok[:, None] & d_ok[None, :]
                at_q = (bh * M + offs_m[:, None]) * HD + offs_d[None, :]
                q = tl.load(Q + at_q, mask=md_ok, other=0.0)  # [BM, BD]
                do = tl.load(DO + at_q, mask=md_ok, other=0.0)
                rows = tl.load(ROWS + offs_m, mask=m_ok, other=-1)
                lse = tl.load(LSE + bh * M + offs_m, mask=m_ok, other=float("inf"))
                delta = tl.load(DELTA + bh * M + offs_m, mask=m_ok, other=0.0)
                st = _dot(k, tl.trans(q), PREC, F32) * scale  # [BN, BM]
                ok = (offs_n[:, None] <= rows[None, :]) & key_ok[:, None] & m_ok[None, :]
                p = tl.where(ok, tl.exp(st - lse[None, :]), 0.0)
                dv += _dot(p.to(do.dtype), do, PREC, F32)
                dpt = _dot(v, tl.trans(do), PREC, F32)  # [BN, BM]
                dst = p * (dpt - delta[None, :])
                dk += _dot(dst.to(q.dtype), q, PREC, F32) * scale
        tl.store(GK + at_k, dk, mask=nd_ok)
        tl.store(GV + at_k, dv, mask=nd_ok)
