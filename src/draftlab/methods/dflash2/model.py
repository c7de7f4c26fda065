"""The DFlash2 draft: DFlash's block pass with a dynamic convolution around every sublayer, plus a selector.

**Block convolutions.** Around each attention and each MLP sublayer, a grouped, dynamic, depthwise, causal
convolution over the positions of a block (``k = conv_kernel_size`` taps): for block row ``t`` and channel
``c`` in group ``g(c)`` (``conv_group_size`` channels per group),

    out[t, c] = sum_{j < k, j <= slot(t)} (base[j, c] + delta[t, j, g(c)]) * x[t - j, c]

where ``slot(t)`` is the row's position inside its block, so no tap crosses a block boundary (packed training
blocks never see each other, as in DFlash's attention). ``delta`` comes from one linear projection of the
sublayer's normed input (``kernel_projection: d -> 2 * k * groups``): half of it shapes the convolution
before the sublayer (on its input), half the one after it (on its output), with two base kernels
(``base_kernel [2, k, d]``). Base = identity (tap 0 = 1, later taps 0) and a zero projection make every
convolution the identity, so a fresh DFlash2 computes exactly what its DFlash does and can start from a
trained DFlash draft. The layout follows vLLM's ``qwen3_dflash2.py`` (the names are its weight names).

**Candidate selector.** Each slot's unary top-K candidates (K = ``selector_top_k`` of the LM head's logits)
are re-scored by an edge with the previous token of the walk:

    score(prev, c) = logit(c) + < A[prev] * (P h_t), B[c] >        (A, B: [V, r] codebooks, P: d -> r)

``h_t`` is the slot's final-norm state (what the LM head reads). The drafter walks the block left to right
from the verified token (``drafter.py``). The edge is zero while ``P`` is zero, so a fresh selector ranks
candidates exactly as the unary logits do.

The context path (``fc``, ``hidden_norm``, every layer's context K/V) is DFlash's, unchanged: the
convolutions act on block rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.methods.dflash.model import DFlashDraft, DFlashLayer
from draftlab.methods.dflash2.config import DFlash2Config
from draftlab.nn.placement import target_device


class BlockConv(nn.Module):
    """The dynamic grouped convolution pair around one sublayer (see the module docstring)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0  # identity: tap 0 passes the row through, later taps add nothing
        self.base_kernel = nn.Parameter(base)  # [2, k, d]: before / after the sublayer
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic coefficients of normed rows ``x [B, Q, d]`` -> ``[B, Q, 2, k, groups]``."""
        B, Q, _ = x.shape
        return self.kernel_projection(x).view(B, Q, 2, self.taps, self.groups)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        """``x [B, Q, d]`` (Q = whole blocks of ``block_size``) convolved with ``base[side] + delta[:, :, side]``."""
        B, Q, d = x.shape
        xg = x.view(B, Q, self.groups, self.group_size)  # [B, Q, G, gs]
        coef = (self.base_kernel[side].view(1, 1, self.taps, self.groups, self.group_size)
                + delta[:, :, side, :, :, None])  # [B, Q, k, G, gs]
        out = coef[:, :, 0] * xg
        slot = torch.arange(Q, device=x.device) % block_size  # [Q] row's position in its block
        for j in range(1, self.taps):
            earlier = F.pad(xg[:, : Q - j], (0, 0, 0, 0, j, 0))  # [B, Q, G, gs]: row t - j (zeros before row 0)
            out = out + coef[:, :, j] * earlier * (slot >= j).view(1, Q, 1, 1).to(x.dtype)
        return out.view(B, Q, d)


class DFlash2Layer(DFlashLayer):
    """A DFlash layer whose attention and MLP each sit between the two halves of a ``BlockConv``."""

    def __init__(self, c: DFlash2Config):
        super().__init__(c)
        self.attention_conv = BlockConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.mlp_conv = BlockConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int) -> torch.Tensor:
        h = self.input_layernorm(x)  # [B, Q, d]
        delta = self.attention_conv.deltas(h)
        h = self.attention_conv.convolve(h, delta, 0, block_size)
        a = self.self_attn(h, cos, sin, k_ctx, v_ctx, ctx_mask, block_size)
        x = x + self.attention_conv.convolve(a, delta, 1, block_size)  # [B, Q, d]
        h = self.post_attention_layernorm(x)
        delta = self.mlp_conv.deltas(h)
        m = self.mlp(self.mlp_conv.convolve(h, delta, 0, block_size))
        return x + self.mlp_conv.convolve(m, delta, 1, block_size)  # [B, Q, d]


class CandidateSelector(nn.Module):
    """Low-rank edge scores between a predecessor token and a slot's candidates (see the module docstring).

    The codebooks start random (scale ``r^-1/2``, so an edge has the scale of ``P h``) and ``P`` at zero: the
    selector starts as the identity re-ranking and its first gradients reach ``P`` through the codebooks.
    PROPOSAL: the reference initialisation is not published.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.5)  # [V, r]
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.5)  # [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``P h``: slot states ``[..., d]`` -> ``[..., r]`` (once per slot, whatever the predecessor)."""
        return self.hidden_projection(hidden)

    def edges(self, previous: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """Edge scores ``[..., P, K]`` (fp32) from predecessor ids ``[..., P]``, candidate ids ``[..., K]`` and
        projected slot states ``[..., r]`` (``project``)."""
        a = self.predecessor_codebook[previous] * projected[..., None, :]  # [..., P, r]
        b = self.successor_codebook[candidates]  # [..., K, r]
        return (a @ b.transpose(-1, -2)).float()  # [..., P, K]


class DFlash2Draft(DFlashDraft):
    """A DFlash draft with ``DFlash2Layer`` layers and a ``candidate_selector`` (see the module docstring)."""

    config_class = DFlash2Config
    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config, target=None):
        super().__init__(config)
        c = config
        self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k)
        if target is not None:
            self.to(target_device(target)).share_target_weights(target)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's unary top-K: logits ``[..., V]`` -> (values ``[..., K]`` fp32, ids ``[..., K]``)."""
        values, ids = logits.float().topk(self.config.selector_top_k, dim=-1)
        return values, ids
