"""Backend ``hf``: a frozen transformers causal LM with an explicit-cache, explicit-mask forward.

Any causal LM loads through transformers (local path, hub id, or a draftlab asset), so tokenizer, chat
template and HF ``generate`` are always available. The speculative-decoding forward — explicit KV cache,
explicit position ids, an arbitrary [T, S] attention mask for tree verification, auxiliary hidden-state
capture — is a short re-statement of the decoder stack that calls the HF model's own sub-modules (norms,
projections, MLP, rotary embedding), so it shares every weight and numeric detail with HF and only
replaces the cache/mask plumbing. It covers the Llama family (llama, mistral, qwen2, qwen3); other
architectures load but raise a clear error when this forward is asked of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.decoding.cache import KVCache
from draftlab.targets.base import Geometry, LayerConvention, TargetOutput, default_aux_layer_ids
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class HFTarget:
    """A frozen HF causal LM exposing the ``Target`` protocol."""

    def __init__(self, model, tokenizer, *, aux_layer_ids: list[int] | None = None,
                 layer_convention: LayerConvention | str = LayerConvention.OUTPUT_OF, name: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "target")
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.geometry = Geometry(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=head_dim,
            vocab_size=cfg.vocab_size, intermediate_size=getattr(cfg, "intermediate_size", 0),
            model_type=cfg.model_type,
        )
        self.layer_convention = LayerConvention(layer_convention)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(
            self.geometry.num_layers, self.layer_convention)
        self._check_aux_ids()
        self.eos_token_ids = self._eos_ids()

    # ------------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, *, dtype: str | torch.dtype = "float32",
                        device: str = "cpu", **kwargs) -> HFTarget:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path_or_id))
        model = AutoModelForCausalLM.from_pretrained(str(path_or_id), dtype=resolve_dtype(dtype)).to(device)
        return cls(model, tok, name=str(path_or_id), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            for i in (src if isinstance(src, (list, tuple)) else [src]):
                if i is not None and i not in ids:
                    ids.append(int(i))
        return ids

    def _check_aux_ids(self) -> None:
        L = self.geometry.num_layers
        lo, hi = 0, L - 1
        bad = [i for i in self.aux_layer_ids if not lo <= i <= hi]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range [{lo}, {hi}] for a {L}-layer target "
                             f"under the '{self.layer_convention.value}' convention")

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        g = self.geometry
        return KVCache(g.num_layers, batch_size, g.num_kv_heads, g.head_dim, max_length,
                       dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------------------------------------
    # forward

    def _decoder(self):
        if self.geometry.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"the explicit-cache forward supports {SUPPORTED_MODEL_TYPES}; '{self.geometry.model_type}' "
                "loads (tokenizer, HF generate) but cannot be verified against yet")
        return self.model.model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None, *,
                return_aux: bool = False, return_last_hidden: bool = False,
                logits_rows: torch.Tensor | None = None, input_embeds: torch.Tensor | None = None) -> TargetOutput:
        """Run the target on T new rows.

        input_ids    [B, T]; or ``input_embeds [B, T, d]`` for rows that are not vocabulary tokens.
        position_ids [B, T] or [T]; default ``past + arange(T)`` (trees pass ``past + depth``).
        cache        the rows are written to the cache's scratch slots and attend to ``[0, past + T)``;
                     ``cache.commit*`` decides what stays. Without a cache the rows attend only to each other.
        attn_mask    bool [B, T, S] or [T, S] with S = past + T (True = may attend); default causal.
        logits_rows  optional [R] indices of rows whose logits are needed (saves the LM head elsewhere).
        """
        m = self._decoder()
        x = m.embed_tokens(input_ids) if input_embeds is None else input_embeds.to(self.dtype)  # [B, T, d]
        B, T, _ = x.shape
        past = cache.reserve(T) if cache is not None else 0
        S = past + T
        if position_ids is None:
            position_ids = torch.arange(past, S, device=x.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(B, T)
        cos, sin = m.rotary_emb(x, position_ids)  # [B, T, hd] each, in x's dtype
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]

        if attn_mask is None:
            # Plain causal over the new rows; a single row needs no mask at all.
            mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=x.device).tril(past)
        else:
            if attn_mask.shape[-2:] != (T, S):
                raise ValueError(f"attn_mask must be [.., {T}, {S}] (new rows x (past + new)), got {tuple(attn_mask.shape)}")
            mask = attn_mask
        if mask is not None:
            mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask  # [B|1, 1, T, S]

        g = self.geometry
        want_aux = return_aux and bool(self.aux_layer_ids)
        capture_in = {i for i in self.aux_layer_ids} if self.layer_convention is LayerConvention.INPUT_TO else set()
        capture_out = {i for i in self.aux_layer_ids} if self.layer_convention is LayerConvention.OUTPUT_OF else set()
        captured: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(m.layers):
            if want_aux and li in capture_in:
                captured[li] = x
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, g.num_heads, g.head_dim).transpose(1, 2)  # [B, H, T, hd]
            k = attn.k_proj(h).view(B, T, g.num_kv_heads, g.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
            v = attn.v_proj(h).view(B, T, g.num_kv_heads, g.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
            if hasattr(attn, "q_norm"):  # qwen3 normalises q/k per head before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if cache is not None:
                k, v = cache.write(li, past, k, v)  # [B, Hkv, S, hd]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=g.num_kv_heads != g.num_heads)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, T, g.num_heads * g.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if want_aux and li in capture_out:
                captured[li] = x
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if want_aux else None  # [B, T, 3d]
        hidden = m.norm(x if logits_rows is None else x[:, logits_rows])
        logits = self.model.lm_head(hidden)  # [B, T|R, V]
        return TargetOutput(logits=logits, aux_hidden=aux, last_hidden=hidden if return_last_hidden else None)

    __call__ = forward
