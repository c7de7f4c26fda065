"""The DFlash block draft: fused target context injected as extra K/V into every layer of a small decoder.

A block is ``[anchor, MASK x (B-1)]`` at positions ``a .. a+B-1``. Every draft layer attends, from the
block rows, to (i) the context: K/V projected from ``c = hidden_norm(fc(concat of tapped target states))``
of the committed tokens strictly before the anchor, and (ii) the block's own rows, bidirectionally. The
context K/V of a layer depend on ``c`` only (not on the draft's earlier layers), so a drafter computes
them once per committed token and caches them; only the B block rows run through the layers.

The input embedding and the LM head are the target's, shared and frozen: the draft holds them as
non-persistent buffers (never in ``state_dict``, never trained, never exported). Parameter names are
those of the DFlash HF checkpoints (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.*``, ``norm``), so export is an identity map.

Several blocks may be packed in one call (training): rows ``[j*B, (j+1)*B)`` form block j, and blocks
never see each other; which context positions each row sees is an explicit ``ctx_mask``. A draft with a
``sliding_window`` narrows that mask itself (``forward_blocks``), so training and the drafter cannot disagree on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.methods.dflash.config import DFlashConfig
from draftlab.nn import RMSNorm, Rotary, apply_rotary
from draftlab.nn.placement import same_device, target_device
from draftlab.nn.window import in_window
from draftlab.targets.base import to_convention

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [B, Hkv, S, hd], rotated


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int,
                    scale: float) -> torch.Tensor:
    """Attention of packed block rows over context keys plus their own block's keys (one softmax).

    q, k_blk, v_blk [B, H|Hkv, Q, hd] with Q = A * block_size (A blocks, each bidirectional and isolated);
    k_ctx, v_ctx [B, Hkv, S, hd]; ctx_mask bool [B|1, Q, S] (True = row may see that context key) or None
    (all visible) -> [B, H, Q, hd]. Block scores are computed per block ([bs, bs]), never as a [Q, Q]
    matrix, so packing many anchors costs A * bs^2, not (A * bs)^2.
    """
    B, H, Q, hd = q.shape
    Hkv, S = k_ctx.shape[1], k_ctx.shape[2]
    G, A, bs = H // Hkv, Q // block_size, block_size
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(B, Hkv, G, Q, hd)  # heads h = kv * G + g share KV head kv
    s_ctx = torch.matmul(qg, k_ctx[:, :, None].transpose(-1, -2)).to(ct) * scale  # [B, Hkv, G, Q, S]
    if ctx_mask is not None:
        s_ctx = s_ctx.masked_fill(~ctx_mask.reshape(-1, 1, 1, Q, S), torch.finfo(ct).min)
    kb = k_blk.reshape(B, Hkv, 1, A, bs, hd)
    s_blk = torch.matmul(qg.reshape(B, Hkv, G, A, bs, hd), kb.transpose(-1, -2))  # [B, Hkv, G, A, bs, bs]
    scores = torch.cat([s_ctx, s_blk.reshape(B, Hkv, G, Q, bs).to(ct) * scale], dim=-1)  # [B, Hkv, G, Q, S+bs]
    probs = torch.softmax(scores, dim=-1).to(v_ctx.dtype)
    out = torch.matmul(probs[..., :S], v_ctx[:, :, None])  # [B, Hkv, G, Q, hd]
    p_blk = probs[..., S:].reshape(B, Hkv, G, A, bs, bs)
    out = out + torch.matmul(p_blk, v_blk.reshape(B, Hkv, 1, A, bs, hd)).reshape(B, Hkv, G, Q, hd)
    return out.reshape(B, H, Q, hd)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        # Qwen3-style per-head norms, applied before RoPE (the DFlash checkpoints carry them).
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values ``[B, Hkv, T, hd]`` of rows ``x [B, T, d]`` (context or block rows)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        return apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int) -> torch.Tensor:
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)  # [B, H, Q, hd]
        q = apply_rotary(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)  # [B, Hkv, Q, hd]
        o = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask, block_size, self.scale)  # [B, H, Q, hd]
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))  # [B, Q, d]


class DFlashMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DFlashMLP(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, ctx_mask, block_size)  # [B, Q, d]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, Q, d]


class DFlashDraft(nn.Module):
    """DFlash draft (see the module docstring). ``target``: move to its device and take the shared embedding /
    LM head from it now."""

    config_class = DFlashConfig  # what its export's config.json is read into
    layer_class = DFlashLayer  # a successor's layers (DFlash2 wraps each sublayer in a convolution)

    def __init__(self, config: DFlashConfig, target=None):
        super().__init__()
        c = self.config = config
        d = c.hidden_size
        self.fc = nn.Linear(c.num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)
        # The target's tensors themselves (no copy); non-persistent, so checkpoints and exports omit them.
        self.register_buffer("embed_weight", None, persistent=False)  # [V, d]
        self.register_buffer("lm_head_weight", None, persistent=False)  # [V, d]
        self.register_buffer("lm_head_bias", None, persistent=False)  # [V] or None
        if target is not None:
            self.to(target_device(target)).share_target_weights(target)

    # ---- the target's shared, frozen pieces ------------------------------------------------------------

    @torch.no_grad()
    def share_target_weights(self, target) -> None:
        """Point the draft at ``target``'s input embedding and LM head (frozen; shapes checked).

        The draft's own weights must already be on the device of the target's (``build_draft`` and ``load``
        put them there): a draft on another device would run half its pass on each, copying every block's
        states across. ``ValueError`` naming both devices otherwise."""
        model = getattr(target, "model", target)
        emb = model.get_input_embeddings().weight.detach()  # [V, d]
        head = model.get_output_embeddings()
        V, d = self.config.vocab_size, self.config.hidden_size
        if tuple(emb.shape) != (V, d) or tuple(head.weight.shape) != (V, d):
            raise ValueError(f"target embedding {tuple(emb.shape)} / LM head {tuple(head.weight.shape)} do not fit "
                             f"the draft's vocab_size={V}, hidden_size={d}")
        own = self.fc.weight.device
        for name, shared in (("embedding", emb), ("LM head", head.weight)):
            if not same_device(shared.device, own):
                raise ValueError(f"the DFlash draft's weights are on {own} but the target's {name} is on "
                                 f"{shared.device}: move the draft first (draft.to({str(shared.device)!r}))")
        dtype = self.fc.weight.dtype
        self.embed_weight = emb.to(dtype)
        self.lm_head_weight = head.weight.detach().to(dtype)
        self.lm_head_bias = None if getattr(head, "bias", None) is None else head.bias.detach().to(dtype)

    def _need_shared(self) -> None:
        if self.embed_weight is None:
            raise RuntimeError("the DFlash draft has no target embedding / LM head: call share_target_weights(target)")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of ``ids [..]`` -> ``[.., d]``."""
        self._need_shared()
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on draft states ``[.., d]`` (already through the draft's ``norm``) -> ``[.., V]``."""
        self._need_shared()
        return F.linear(hidden, self.lm_head_weight, self.lm_head_bias)

    def taps(self, target) -> list[int]:
        """The target layers this draft reads, named in ``target``'s layer convention."""
        c = self.config
        return [to_convention(i, c.layer_convention, target.layer_convention) for i in c.target_layer_ids]

    # ---- forward pieces --------------------------------------------------------------------------------

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Context features ``c = hidden_norm(fc(aux))``: ``[B, S, n_taps*d] -> [B, S, d]``."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def _rope(self, positions: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(batch, -1)
        return self.rotary(positions, self.fc.weight.dtype)  # [B, 1, T, hd]

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's rotated context K/V for fused features ``ctx [B, S, d]`` at ``positions [S] | [B, S]``."""
        cos, sin = self._rope(positions, ctx.shape[0])
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward_blocks(self, block_ids: torch.Tensor, positions: torch.Tensor, ctx_kv: ContextKV,
                       ctx_mask: torch.Tensor | None = None, block_size: int | None = None) -> torch.Tensor:
        """Final-norm draft states ``[B, Q, d]`` of packed blocks.

        block_ids  [B, Q] tokens (anchor, then mask ids), Q a multiple of ``block_size`` (default: the
                   config's; inference may run a shorter block).
        positions  [B, Q] or [Q] RoPE positions (anchor position + offset within the block).
        ctx_kv     from ``context_kv``: the context keys every layer attends to, key s at position s (as
                   ``blocks.block_states`` and the drafter's cache lay them out).
        ctx_mask   bool [B|1, Q, S]: which context keys each row sees (None: all), narrowed here to the
                   config's ``sliding_window`` when it has one.
        """
        bs = block_size or self.config.block_size
        if block_ids.shape[1] % bs:
            raise ValueError(f"{block_ids.shape[1]} block rows are not a whole number of blocks of {bs}")
        ctx_mask = self.windowed(ctx_mask, positions, ctx_kv[0][0].shape[2])
        x = self.embed(block_ids).to(self.fc.weight.dtype)  # [B, Q, d]
        cos, sin = self._rope(positions, x.shape[0])
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k_ctx, v_ctx, ctx_mask, bs)
        return self.norm(x)  # [B, Q, d]

    def windowed(self, ctx_mask: torch.Tensor | None, positions: torch.Tensor, num_context: int
                 ) -> torch.Tensor | None:
        """``ctx_mask`` [B|1, Q, S] (None: all keys) and the config's sliding window: a row at position p keeps
        context key s only if ``p - W < s`` (``DFlashConfig``); unchanged without a window."""
        window = self.config.sliding_window
        if window is None:
            return ctx_mask
        rows = positions if positions.dim() == 2 else positions[None]  # [B|1, Q]
        keep = in_window(rows, torch.arange(num_context, device=rows.device), window)  # [B|1, Q, S]
        return keep if ctx_mask is None else ctx_mask & keep
