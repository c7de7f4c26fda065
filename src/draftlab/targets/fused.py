"""The fused per-layer weights of ``HFTarget``'s forward, and where they (and the caches built from them) live.

Decoding a small model on CPU is bound by the number of kernel launches, not FLOPs: one matmul for q/k/v
and one for gate/up halves them. ``fuse_layers`` concatenates q|k|v and gate|up into one matrix each and
re-points the HF modules' parameters at views of those matrices, so HF code (``generate``,
``output_hidden_states``) keeps working and no weight is stored twice.

A view re-pointing does not survive a move: ``model.to(device)`` copies each parameter on its own, so the
fused matrices would stay behind on the old device (and keep their memory). ``placement`` names where the
weights are now; the target compares it with the placement it fused for and fuses again when they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def placement(weight: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """Where a weight lives and in which dtype: what the fused matrices and cached tables depend on."""
    return weight.device, weight.dtype


def fuse_layers(model) -> list[dict]:
    """Per decoder layer of an HF Llama-family ``model``: its weights for the explicit forward, q|k|v and
    gate|up fused into ``wqkv`` / ``wgu`` (the HF parameters re-pointed at views of them)."""
    act = getattr(model.config, "hidden_act", "silu")
    return [_fuse_layer(layer, act) for layer in model.model.layers]


def _fuse_layer(layer, act: str) -> dict:
    a, mlp = layer.self_attn, layer.mlp
    projs = [a.q_proj, a.k_proj, a.v_proj]
    wqkv = torch.cat([p.weight.detach() for p in projs], 0)
    bqkv = torch.cat([p.bias.detach() for p in projs], 0) if a.q_proj.bias is not None else None
    wgu = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()], 0)
    off = 0
    for p in projs:
        n = p.weight.shape[0]
        p.weight.data = wqkv[off:off + n]
        if bqkv is not None:
            p.bias.data = bqkv[off:off + n]
        off += n
    ni = mlp.gate_proj.weight.shape[0]
    mlp.gate_proj.weight.data, mlp.up_proj.weight.data = wgu[:ni], wgu[ni:]
    return dict(
        ln1=layer.input_layernorm.weight, eps1=layer.input_layernorm.variance_epsilon,
        ln2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.variance_epsilon,
        wqkv=wqkv, bqkv=bqkv, wo=a.o_proj.weight, bo=a.o_proj.bias, wgu=wgu, wd=mlp.down_proj.weight,
        act=F.silu if act == "silu" else mlp.act_fn,
        q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None), scaling=a.scaling,
    )


def cpu_head_pays(model, weight: torch.Tensor) -> bool:
    """Whether a transposed copy of the LM head speeds up single-row logits.

    For a single row on CPU, MKL's x @ W^T is about twice as fast with W^T stored contiguously (measured on
    the 49k x 576 LM head: 7.8 vs 14.2 ms), and the LM head is ~20% of a decode step's bytes: worth one extra
    copy of that matrix there (with more rows the plain layout is faster again). fp32 only: for bf16 that
    layout has no fast kernel and is several times slower. Elsewhere (a GPU) the copy buys nothing and would
    cost as much memory as the head (2 GB at 8B in fp32).
    """
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and model.lm_head.bias is None
