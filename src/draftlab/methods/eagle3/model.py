"""The EAGLE-3 draft model: fc fusion of three target hidden states, one 2d-input Llama layer, a V_d head.

Parameter and buffer names are exactly those of the native EAGLE-3 / SpecForge / SGLang checkpoint
(``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; ``embed_tokens.weight``
is the frozen target embedding and is optional in exports), so exporting is an identity map.

Attention is pluggable: the layer computes rotated q/k/v and hands them to an *attention object*
``attn(layer, q, k, v, scale) -> out``. The same module then serves

- training-time test (``ttt.TTTAttention``: causal over step-0 keys plus the same position's keys from
  later steps),
- a plain causal pass (``CausalAttention``), and
- inference against a persistent draft KV cache (``CacheAttention`` over ``draftlab.decoding.KVCache``,
  with an explicit tree mask),

without the layer knowing which one it runs under. A draft with a ``sliding_window`` passes it to every call
(``attn(layer, q, k, v, scale, window=W)``) and refuses an attention object that takes no ``window``, so no
back-end can silently attend past it; a draft without one calls exactly as before.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.nn import RMSNorm, Rotary, apply_rotary, compute_dtype
from draftlab.nn.placement import target_device
from draftlab.nn.window import in_window
from draftlab.targets.base import to_convention
from draftlab.targets.cache import KVCache

# ------------------------------------------------------------------------------------------------------
# attention back-ends


class DraftAttention(Protocol):
    """How a draft layer attends: ``q [B, H, T, hd]``, ``k, v [B, Hkv, T, hd]`` (rotated) -> ``[B, H, T, hd]``.

    A back-end that can apply a sliding window takes a keyword ``window`` (``Eagle3Config.sliding_window``)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...


_TAKES_WINDOW: dict[object, bool] = {}  # per back-end class (per function for plain functions)


def _takes_window(attention) -> bool:
    key = attention if inspect.isfunction(attention) else type(attention)
    if key not in _TAKES_WINDOW:
        params = inspect.signature(attention).parameters.values()
        _TAKES_WINDOW[key] = any(p.name == "window" or p.kind is p.VAR_KEYWORD for p in params)
    return _TAKES_WINDOW[key]


def attend(attention: DraftAttention, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window: int | None) -> torch.Tensor:
    """``attention(layer, q, k, v, scale)``, with ``window=`` when the draft has one; ``ValueError`` for a back-end
    whose ``__call__`` takes no ``window`` (it would attend past the window the draft was built for)."""
    if window is None:
        return attention(layer, q, k, v, scale)
    if not _takes_window(attention):
        raise ValueError(f"{type(attention).__name__} applies no sliding window, but the draft has "
                         f"sliding_window={window}")
    return attention(layer, q, k, v, scale, window=window)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Grouped-query softmax attention with an explicit boolean mask.

    q [B, H, T, hd], k/v [B, Hkv, S, hd], mask bool [B|1, T, S] (True = may attend) or None -> [B, H, T, hd].
    Masked scores are set to the dtype's minimum rather than -inf, so a row with nothing to attend to
    (a left-padding query) yields a finite, ignored output instead of NaNs that poison gradients.
    """
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, hd)  # heads h = kv * G + g share KV head kv
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(B, Hkv, G, T, S)  # [B, Hkv, G, T, S]
    scores = scores.to(compute_dtype(scores.dtype)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(-1, 1, 1, T, S), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, Hkv, G * T, S)
    return torch.matmul(probs, v).view(B, H, T, hd)


def causal_mask(T: int, attention_mask: torch.Tensor | None = None, *,
                device: torch.device | str | None = None, window: int | None = None) -> torch.Tensor:
    """bool ``[B|1, T, T]``: causal, and (given ``attention_mask [B, T]``, 1 = real) no padded keys; with a sliding
    ``window`` W, row t sees only keys ``t - W < s <= t`` (W <= 0: none)."""
    if attention_mask is not None:
        device = attention_mask.device
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]  # [1, T, T]
    if window is not None:
        mask = mask & ~torch.ones(T, T, dtype=torch.bool, device=device).tril(-window)  # drop s <= t - W
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, :]  # [B, T, T]
    return mask


class CausalAttention:
    """Plain causal attention over the rows of one call (plus a key padding mask); keeps no state."""

    def __init__(self, attention_mask: torch.Tensor | None = None):
        self.attention_mask = attention_mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                 window: int | None = None) -> torch.Tensor:
        mask = causal_mask(q.shape[2], self.attention_mask, device=q.device, window=window)
        return masked_attention(q, k, v, mask, scale)


class CacheAttention:
    """Attention against a draft KV cache (``draftlab.decoding.KVCache``, one slot per draft layer).

    The call's T rows are written to the cache's scratch slots ``[length, length + T)`` and attend to
    ``[0, length + T)`` under ``attn_mask`` (bool ``[T, S]`` or ``[B, T, S]``, ``S = length + T``; default
    causal). Nothing becomes context until the caller runs ``cache.commit(n)`` / ``commit_rows`` after
    the forward, which is what lets a drafter expand tree frontiers and then keep only accepted rows.

    ``key_positions`` [S]: the position of every cached and new row (the new rows' are the last T), which a
    draft's sliding ``window`` needs (``in_window``); the side keys are never windowed.
    """

    def __init__(self, cache: KVCache, attn_mask: torch.Tensor | None = None, side: SideKeys | None = None,
                 key_positions: torch.Tensor | None = None):
        self.cache = cache
        self.attn_mask = attn_mask
        self.side = side
        self.key_positions = key_positions

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                 window: int | None = None) -> torch.Tensor:
        T = q.shape[2]
        past = self.cache.reserve(T)
        k_all, v_all = self.cache.write(layer, past, k, v)  # [B, Hkv, past + T, hd]
        S = past + T
        mask = self.attn_mask
        if mask is None:
            if not (T == 1 and self.side is None and window is None):
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(past)
        elif mask.shape[-2:] != (T, S):
            raise ValueError(f"attn_mask must be [.., {T}, {S}] (new rows x (cached + new)), got {tuple(mask.shape)}")
        if window is not None:
            mask = mask & self._window(window, T, S)
        if self.side is not None:
            k_all, v_all, mask = self.side.extend(layer, k_all, v_all, mask)
        return masked_attention(q, k_all, v_all, mask, scale)

    def _window(self, window: int, T: int, S: int) -> torch.Tensor:
        """bool ``[T, S]``: the keys within ``window`` of each new row, by ``key_positions``."""
        pos = self.key_positions
        if pos is None or pos.shape[0] != S:
            raise ValueError(f"a sliding window needs key_positions for all {S} rows (cached + new), got "
                             f"{None if pos is None else tuple(pos.shape)}: DraftRows passes them")
        return in_window(pos[S - T:], pos, window)


@dataclass
class SideKeys:
    """Keys/values outside the draft cache that a pass's rows also attend to (ConFu's future tokens).

    kv    one ``(k, v)`` pair per draft layer, each ``[1, Hkv, P, hd]`` (already rotated at their positions).
    mask  bool ``[T, P]``: which of the pass's T rows sees which side key; None = every row sees all.
    Keeping them out of the cache means committed rows never have to move around them.
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor | None = None

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``k/v [B, Hkv, S, hd]`` with the side keys appended, ``mask [.., T, S]`` widened to ``S + P``."""
        sk, sv = self.kv[layer]
        T, P = mask.shape[-2], sk.shape[2]
        side = (self.mask.to(device=mask.device, dtype=torch.bool) if self.mask is not None
                else torch.ones(T, P, dtype=torch.bool, device=mask.device))
        if side.shape != (T, P):
            raise ValueError(f"side key mask must be [{T}, {P}] (rows x side keys), got {tuple(side.shape)}")
        side = side.expand(*mask.shape[:-1], P)
        return (torch.cat([k, sk.to(k.dtype).expand(k.shape[0], -1, -1, -1)], dim=2),
                torch.cat([v, sv.to(v.dtype).expand(v.shape[0], -1, -1, -1)], dim=2),
                torch.cat([mask, side], dim=-1))


# ------------------------------------------------------------------------------------------------------
# modules


# Rows for which a reduced-precision (bf16/fp16) CPU product is computed weight-major: ``W @ x.T`` for 2..32
# rows and ``torch.mv`` for one. oneDNN's small-row ``x @ W.T`` is slower there on every draft shape
# (SmolLM2-sized draft, 2 cores; head 32000 x 576: 1 row 2.2 -> 1.2 ms, 3 rows 2.0 -> 1.4 ms; q|k|v-sized
# 960 x 1152, 1 row 0.17 -> 0.10 ms; experiments/engine_baseline part e). fp32 keeps ``F.linear``: MKL's
# small-row GEMM beats the weight-major product in fp32 (same head, 3 rows: 2.0 vs 5.1 ms).
_WEIGHT_MAJOR_MAX_ROWS = 32


class DraftLinear(nn.Linear):
    """``nn.Linear`` (same parameters, names and hooks) with faster CPU kernels for inference passes of a
    few rows in bf16/fp16 (``_WEIGHT_MAJOR_MAX_ROWS``); training and fp32 run ``F.linear`` unchanged.

    The weight-major result is returned as the transposed view of ``W @ x.T`` (not copied: a bf16
    transposing copy of a 32000-wide head costs a third of the product); every consumer accepts strides.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (1 <= rows <= _WEIGHT_MAJOR_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
                and x.device.type == "cpu" and self.bias is None and not torch.is_grad_enabled()):
            x2 = x.reshape(rows, x.shape[-1])  # [rows, in]
            if rows == 1:
                y = torch.mv(self.weight, x2[0])[None]  # [1, out]
            else:
                y = torch.mm(self.weight, x2.T).T  # [rows, out], strides (1, rows)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config, in_features: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.q_proj = DraftLinear(in_features, c.num_heads * c.head_dim, bias=False)
        self.k_proj = DraftLinear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = DraftLinear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = DraftLinear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.sliding_window = c.sliding_window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: DraftAttention,
                layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend(attention, layer, q, k, v, self.scale, self.sliding_window)  # [B, H, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * hd))  # [B, T, d]


class Eagle3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = DraftLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = DraftLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = DraftLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """``first=True``: the EAGLE-3 midlayer (q/k/v read [norm(emb); norm(h)], 2d wide); otherwise a plain
    Llama layer on the d-dim residual stream (additional layers see no embedding, as in vLLM/SGLang)."""

    def __init__(self, config: Eagle3Config, first: bool):
        super().__init__()
        c, d = config, config.hidden_size
        self.first = first
        self.norm_before_residual = c.norm_before_residual and first
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, 2 * d if first else d)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.mlp = Eagle3MLP(d, c.intermediate_size)

    def forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: DraftAttention, layer: int) -> torch.Tensor:
        if self.first:
            h_norm = self.hidden_norm(hidden)  # [B, T, d]
            x = torch.cat([self.input_layernorm(emb), h_norm], dim=-1)  # [B, T, 2d]
            residual = h_norm if self.norm_before_residual else hidden
        else:
            x, residual = self.input_layernorm(hidden), hidden
        h = residual + self.self_attn(x, cos, sin, attention, layer)  # [B, T, d]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, d]


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head (see the module docstring for names and the attention plumbing)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        d, dt = c.hidden_size, c.target_hidden_size
        # Copied from the target and frozen (load_target_embedding); serving reuses the target's own.
        self.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.embed_tokens.weight.requires_grad_(False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(dt, c.rms_norm_eps) for _ in range(3))
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * dt, c.rms_norm_eps)
        self.fc = DraftLinear(3 * dt, d, bias=False)
        self.midlayer = Eagle3DecoderLayer(c, first=True)
        # Named additional_layers.{i} (i from 0) for layers 2..num_layers; empty for the native 1-layer draft.
        self.additional_layers = nn.ModuleList(Eagle3DecoderLayer(c, first=False) for _ in range(c.num_layers - 1))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lm_head = DraftLinear(d, c.draft_vocab_size, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)
        # Identity mapping until a real one is set: draft id i <-> target id i.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # [V_d]
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)  # [V]
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # ---- construction helpers ------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target, *, vocab_mapping=None, draft_vocab_size: int | None = None,
                    **config_kwargs) -> Eagle3Draft:
        """Draft sized like ``target`` on the target's device, with its embedding copied and frozen and
        ``vocab_mapping`` installed.

        ``config_kwargs`` go to ``Eagle3Config.from_target`` (aux ids, convention, any field override). The
        weights are drawn on the CPU and then moved, so a seed gives the same draft whatever the device.
        """
        if vocab_mapping is not None:
            draft_vocab_size = vocab_mapping.draft_vocab_size
        if draft_vocab_size is None:
            raise ValueError("give vocab_mapping or draft_vocab_size")
        draft = cls(Eagle3Config.from_target(target, draft_vocab_size=draft_vocab_size, **config_kwargs))
        draft.to(target_device(target))
        draft.load_target_embedding(target)
        if vocab_mapping is not None:
            draft.set_vocab_mapping(vocab_mapping)
        return draft

    @torch.no_grad()
    def load_target_embedding(self, target) -> None:
        """Copy the target's input embedding (``[V, d]``) into ``embed_tokens`` and freeze it."""
        model = getattr(target, "model", target)
        weight = model.get_input_embeddings().weight
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            # EAGLE skips the copy when target and draft widths differ; silently training on a random
            # frozen embedding is worse than failing, so ask for an explicit decision instead.
            raise ValueError(f"target embedding {tuple(weight.shape)} does not fit the draft's "
                             f"{tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def set_vocab_mapping(self, mapping) -> None:
        """Install a ``draftlab.data.vocab.VocabMapping`` (``d2t [V_d]``, ``t2d [V]``)."""
        if mapping.d2t.shape != self.d2t.shape or mapping.t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping sizes (V_d={mapping.d2t.numel()}, V={mapping.t2d.numel()}) do not "
                             f"match the draft (V_d={self.d2t.numel()}, V={self.t2d.numel()})")
        self.d2t.copy_(mapping.d2t)
        self.t2d.copy_(mapping.t2d)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """A preallocated draft KV cache (one slot per draft layer) for ``CacheAttention``."""
        c, w = self.config, self.fc.weight
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_length, dtype=w.dtype, device=w.device)

    def taps(self, target) -> list[int]:
        """The target layers this draft reads, named in ``target``'s layer convention."""
        c = self.config
        return [to_convention(i, c.layer_convention, target.layer_convention) for i in c.aux_layer_ids]

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id (``d2t + arange(V_d)``), i.e. what each lm_head row predicts."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)  # [V_d]

    # ---- forward --------------------------------------------------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the concatenated target states ``[B, T, 3*d_t]`` into ``g [B, T, d]`` (variant norm, then fc)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = x.chunk(3, dim=-1)  # 3 x [B, T, d_t]
            x = torch.cat([norm(h) for norm, h in zip(self.fc_norm, chunks)], dim=-1)  # [B, T, 3*d_t]
        elif self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)  # [B, T, d]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits ``[B, T, V_d]`` from the pre-norm hidden state (in the head's dtype, which an
        inference copy may set apart from the rest, e.g. a bf16 head on an fp32 draft)."""
        x = self.norm(hidden) if self.config.norm_output else hidden
        return self.lm_head(x.to(self.lm_head.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention: DraftAttention | None = None, logits_rows: slice | torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.config.hidden_size
        if hidden.shape[-1] != d:
            # Target features (3*d_t) go through fc; the draft's own fed-back state (d) does not (sec. 1.2).
            hidden = self.project(hidden)  # [B, T, d]
        hidden = hidden.to(self.fc.weight.dtype)
        B, T = input_ids.shape
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(B, T)
        attention = attention if attention is not None else CausalAttention()
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, d]
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, 1, T, hd]
        h = self.midlayer(emb, hidden, cos, sin, attention, 0)  # [B, T, d]
        for i, layer in enumerate(self.additional_layers, start=1):
            h = layer(None, h, cos, sin, attention, i)
        return h, self.compute_logits(h if logits_rows is None else h[:, logits_rows])

    def forward_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                     attention: DraftAttention | None = None, *, logits_rows: slice | torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over T rows; returns ``(hidden [B, T, d] pre-norm, logits [B, T, V_d])``.

        input_ids    [B, T] target-vocabulary tokens (the token each row consumes).
        hidden       [B, T, 3*d_t] target features (projected by fc) or [B, T, d] draft states (fed back).
        position_ids [B, T] or [T], explicit (TTT step k passes ``positions + k``; trees pass depth offsets).
        attention    a ``DraftAttention``: ``CausalAttention`` (default), ``ttt.TTTAttention`` or
                     ``CacheAttention``. Runs through ``__call__``, so module hooks (FSDP, profilers) fire.
        logits_rows  only these rows (an index or slice of the T dimension) go through the head, e.g.
                     ``slice(-1, None)`` when only the last row's distribution is read: the head is the
                     draft's largest matrix. None (default): every row.
        The returned hidden state is the pre-norm residual stream, the one fed to the next draft step.
        """
        return self(input_ids, hidden, position_ids, attention, logits_rows)
