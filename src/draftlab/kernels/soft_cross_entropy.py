"""Soft-target cross-entropy ``-(p * log_softmax(z)).sum(-1)`` per row, without keeping the fp32 log-softmax.

Shapes: logits ``z`` [N, V] (any float dtype), target ``p`` [N, V] (no gradient; rows sum to 1 or are all
zero), result [N] fp32. With ``lse = logsumexp(z)`` and ``s = sum(p)``: ``loss = s * lse - sum(p * z)`` and
``dz = g * (softmax(z) * s - p)``. The fused paths save only the inputs and the [N] lse for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.kernels import _triton
from draftlab.kernels._triton import tl, triton

CHUNK_ELEMENTS = 1 << 24  # rows per chunk = CHUNK_ELEMENTS // V: bounds every fp32 temporary to ~64 MiB


def soft_cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The plain torch definition, [N, V] x [N, V] -> [N] fp32; autograd keeps the fp32 log-softmax."""
    return -(target.float() * F.log_softmax(logits.float(), -1)).sum(-1)


def _rows_per_chunk(n: int, v: int, chunk_elements: int) -> int:
    return max(1, min(n, chunk_elements // max(v, 1)))


class _ChunkedSoftCE(torch.autograd.Function):
    """Torch path in row chunks: forward and backward each hold one chunk's fp32 [rows, V] at a time."""

    @staticmethod
    def forward(ctx, logits, target, chunk_elements):
        n, v = logits.shape
        rows = _rows_per_chunk(n, v, chunk_elements)
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        for a in range(0, n, rows):
            z = logits[a:a + rows].float()  # [rows, V]
            p = target[a:a + rows].float()  # [rows, V]
            row_lse = torch.logsumexp(z, -1)  # [rows]
            lse[a:a + rows] = row_lse
            loss[a:a + rows] = p.sum(-1) * row_lse - (p * z).sum(-1)
        ctx.save_for_backward(logits, target, lse)
        ctx.chunk_elements = chunk_elements
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        rows = _rows_per_chunk(n, v, ctx.chunk_elements)
        grad = torch.empty_like(logits)
        for a in range(0, n, rows):
            z = logits[a:a + rows].float()  # [rows, V]
            p = target[a:a + rows].float()  # [rows, V]
            soft = torch.exp(z - lse[a:a + rows, None])  # softmax recomputed from the saved lse
            grad[a:a + rows] = (g[a:a + rows, None].float() * (soft * p.sum(-1, keepdim=True) - p)).to(grad.dtype)
        return grad, None, None


if triton is not None:

    @triton.jit
    def _soft_ce_fwd_kernel(z_ptr, p_ptr, loss_ptr, lse_ptr, V, stride_z, stride_p, BLOCK_V: tl.constexpr):
        # one program per row: an online max / sum-exp over BLOCK_V tiles, plus sum(p * z) and sum(p)
        row = tl.program_id(0).to(tl.int64)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # running max per lane
        s = tl.zeros([BLOCK_V], tl.float32)  # running sum exp(z - m) per lane
        pz = tl.zeros([BLOCK_V], tl.float32)
        ps = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.load(p_ptr + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, z)
            # lanes still at -inf (all masked so far) would give nan from -inf - -inf: keep them at 0
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(z - m_safe)
            m = m_new
            pz += p * tl.where(mask, z, 0.0)  # masked lanes hold -inf: keep 0 * -inf out
            ps += p
        m_row = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - m_row), 0)
        lse = m_row + tl.log(total)
        sum_p = tl.sum(ps, 0)
        tl.store(loss_ptr + row, sum_p * lse - tl.sum(pz, 0))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _soft_ce_bwd_kernel(z_ptr, p_ptr, lse_ptr, g_ptr, dz_ptr, V, stride_z, stride_p, stride_dz,
                            BLOCK_V: tl.constexpr):
        # one program per row: a first pass for sum(p), a second writes g * (softmax(z) * sum_p - p)
        row = tl.program_id(0).to(tl.int64)
        ps = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ps += tl.load(p_ptr + row * stride_p + cols, mask=cols < V, other=0.0).to(tl.float32)
        sum_p = tl.sum(ps, 0)
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row).to(tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + row * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
            dz = g * (tl.exp(z - lse) * sum_p - p)
            tl.store(dz_ptr + row * stride_dz + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _block_v(v: int) -> int:
    return min(4096, triton.next_power_of_2(v))


class _TritonSoftCE(torch.autograd.Function):
    """Triton path: forward stores loss and lse [N]; backward writes dlogits (into the logits when inplace)."""

    @staticmethod
    def forward(ctx, logits, target, inplace):
        logits = logits.contiguous()
        target = target.contiguous()
        n, v = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # [N]
        if n:
            _soft_ce_fwd_kernel[(n,)](logits, target, loss, lse, v, logits.stride(0), target.stride(0),
                                      BLOCK_V=_block_v(v))
        ctx.save_for_backward(logits, target, lse)
        ctx.inplace = inplace
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, target, lse = ctx.saved_tensors  # raises if logits were modified in place since forward
        n, v = logits.shape
        g = g.contiguous()
        # each element is read before it is written by the same program, so overwriting the logits is safe
        grad = logits if ctx.inplace else torch.empty_like(logits)
        if n:
            _soft_ce_bwd_kernel[(n,)](logits, target, lse, g, grad, v, logits.stride(0), target.stride(0),
                                      grad.stride(0), BLOCK_V=_block_v(v))
        if ctx.inplace:  # the kernel wrote through a raw pointer: tell autograd the logits changed
            torch.autograd.graph.increment_version(logits)
        return grad, None, None


IMPLS = ("auto", "torch", "chunked", "triton")


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, impl: str = "auto",
                       inplace: bool = False, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-row soft-target cross-entropy ``-(target * log_softmax(logits)).sum(-1)`` as fp32 [...].

    ``logits`` and ``target`` are [..., V] of the same shape; ``target`` never gets a gradient. ``impl``:
    ``torch`` (the reference), ``chunked`` (torch in row chunks of ~``chunk_elements``, saving only inputs and
    the row lse), ``triton`` (fused kernels), ``auto`` (triton on CUDA with Triton installed, else chunked).

    ``inplace=True`` (triton only) writes the gradient into the logits' own storage: the logits must not be
    needed after backward. Misuse is an error, not a wrong gradient: if another op saved the same logits for
    its backward, autograd's version counter sees the overwrite and raises when that op's backward runs.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown soft_cross_entropy impl {impl!r}; choose one of {IMPLS}")
    if logits.shape != target.shape or logits.dim() < 1:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must have the same "
                         "[..., V] shape")
    if impl == "auto":
        use_triton = _triton.available(logits.device) and logits.device.type == "cuda"
        impl = "triton" if use_triton else "chunked"
    lead, v = logits.shape[:-1], logits.shape[-1]
    z = logits.reshape(-1, v)  # [N, V]
    p = target.detach().reshape(-1, v)  # [N, V]
    if impl == "torch":
        return soft_cross_entropy_reference(z, p).reshape(lead)
    # The fused paths compute in fp32 from whatever dtypes arrive, with autocast off (as for TTT attention):
    # nothing inside may be recast between forward and backward.
    with torch.autocast(logits.device.type, enabled=False):
        if impl == "chunked":
            loss = _ChunkedSoftCE.apply(z, p, chunk_elements)
        else:
            _triton.require(logits.device)
            if inplace:
                # the backward overwrites what it saved: only when the logits are a tensor of their own
                z = z if z.data_ptr() == logits.data_ptr() and z.is_contiguous() else z.contiguous()
            loss = _TritonSoftCE.apply(z, p, inplace)
    return loss.reshape(lead)
