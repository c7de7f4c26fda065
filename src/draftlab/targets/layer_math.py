"""One decoder layer's math around its attention, shared by the eager forward (``hf._decoder_layer``) and the
compiled passes (``compiled.static_layer``): the two differ only in the product, the cache writes and the mask
plumbing, never in the norms, projections, RoPE or MLP. ``w`` is a layer's fused weights (``fused.fuse_layers``);
``linear`` is the product the caller runs (``F.linear``'s signature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.targets.attention import rotate_half


def layer_projections(target, w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linear):
    """A layer's first half on rows ``x [B, T, d]``: norm, q|k|v, per-head norms, RoPE (cos/sin [B, 1, T, hd]).
    Returns q [B, H, T, hd], k/v [B, Hkv, T, hd]. Shared by the eager and the compiled pass."""
    g = target.geometry
    H, Hkv, hd, d = g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size
    B, T, _ = x.shape
    h = F.rms_norm(x, (d,), w["ln1"], w["eps1"])
    q, k, v = linear(h, w["wqkv"], w["bqkv"]).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
    k = k.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
    v = v.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
    if w["q_norm"] is not None:  # qwen3 normalises q/k per head before RoPE
        q, k = w["q_norm"](q), w["k_norm"](k)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def layer_output(target, w: dict, x: torch.Tensor, o: torch.Tensor, linear) -> torch.Tensor:
    """A layer's second half: attention output ``o [B, H, T, hd]`` projected and added to ``x [B, T, d]``,
    then the MLP block -> [B, T, d]. Shared by the eager and the compiled pass."""
    B, T, d = x.shape
    x = x + linear(o.transpose(1, 2).reshape(B, T, -1), w["wo"], w["bo"])
    gate, up = linear(F.rms_norm(x, (d,), w["ln2"], w["eps2"]), w["wgu"]).chunk(2, dim=-1)
    return x + linear(w["act"](gate) * up, w["wd"])
