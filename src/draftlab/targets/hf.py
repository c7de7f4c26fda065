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


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """Attention for a few query rows against a long cache, heads grouped onto their shared KV head.

    q [B, H, T, hd], k/v [B, Hkv, S, hd], mask bool [B|1, 1, T, S] or None -> [B, H, T, hd].
    On CPU, PyTorch's fused SDPA kernel costs milliseconds per call for T=1 (it is built for long
    queries); two small matmuls cost microseconds. Used for decode steps and verify passes.
    """
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, hd)  # heads h = kv * G + g share KV head kv
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).view(B, Hkv, G, T, S)  # [B, Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # mask [B|1, 1, 1, T, S]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(B, Hkv, G * T, S)
    return torch.matmul(probs, v).view(B, H, T, hd)


# Above this many query rows the fused SDPA kernel wins (prefill).
_GROUPED_ATTENTION_MAX_ROWS = 128


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
        self._layers = self._fuse_weights() if self.geometry.model_type in SUPPORTED_MODEL_TYPES else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos/sin tables [P, hd]
        # For a single row, MKL's x @ W^T is about twice as fast with W^T stored contiguously (measured on
        # the 49k x 576 LM head: 7.8 vs 14.2 ms), and the LM head is ~20% of a decode step's bytes. Worth
        # one extra copy of that matrix; with more rows the plain layout is faster again.
        # fp32 only: for bf16 that layout has no fast kernel here and is several times slower.
        fast = self._layers is not None and self.dtype == torch.float32 and self.model.lm_head.bias is None
        self._lm_head_t = self.model.lm_head.weight.detach().t().contiguous() if fast else None  # [d, V]

    def _fuse_weights(self) -> list[dict]:
        """Per layer: q|k|v and gate|up concatenated into one matrix each.

        Decoding a small model on CPU is bound by the number of kernel launches, not FLOPs: one matmul for
        q/k/v and one for gate/up halves them. The HF modules' parameters are re-pointed at views of the
        fused tensors, so HF code (``generate``, ``output_hidden_states``) keeps working and no weight is
        stored twice.
        """
        layers = []
        for layer in self.model.model.layers:
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
            act = getattr(self.model.config, "hidden_act", "silu")
            layers.append(dict(
                ln1=layer.input_layernorm.weight, eps1=layer.input_layernorm.variance_epsilon,
                ln2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.variance_epsilon,
                wqkv=wqkv, bqkv=bqkv, wo=a.o_proj.weight, bo=a.o_proj.bias, wgu=wgu, wd=mlp.down_proj.weight,
                act=F.silu if act == "silu" else mlp.act_fn,
                q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None), scaling=a.scaling,
            ))
        return layers

    def _rope_tables(self, needed: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, needed), computed by the model's own rotary module, grown by doubling."""
        if self._rope is None or self._rope[0].shape[0] < needed:
            n = max(needed, 2 * (self._rope[0].shape[0] if self._rope else 1024))
            pos = torch.arange(n, device=like.device)[None]
            cos, sin = self.model.model.rotary_emb(like, pos)  # [1, n, hd]
            self._rope = (cos[0], sin[0])
        return self._rope

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
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                                logits_rows, input_embeds, write_cache=True)

    def forward_with_grad(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          cache: KVCache | None = None, attn_mask: torch.Tensor | None = None, *,
                          return_aux: bool = False, return_last_hidden: bool = False,
                          logits_rows: torch.Tensor | None = None,
                          input_embeds: torch.Tensor | None = None) -> TargetOutput:
        """``forward`` under the caller's grad mode, differentiable w.r.t. ``input_embeds`` (the weights stay frozen).

        The cache is only read: the new rows attend to its committed slots ``[0, cache.length)`` (as stored,
        hence constant for autograd) and to each other, and nothing is written to it. Writing grad-carrying
        keys into the shared cache buffer would let a later layer's write invalidate an earlier layer's
        saved tensors, so the keys of each layer are concatenated instead.
        """
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                                logits_rows, input_embeds, write_cache=False)

    __call__ = forward


# Rows for which ``W @ x.T`` beats ``F.linear``: on CPU, MKL runs a 2..64-row ``x @ W.T`` as a GEMM that
# costs about as much as streaming the weights twice, while the weight-major product stays close to one
# weight pass (measured over SmolLM2's layer shapes on 2 cores: 2 rows 42 vs 100 ms, 8 rows 58 vs 84 ms,
# 32 rows 99 vs 168 ms; experiments/engine_baseline). One row keeps F.linear (a GEMV either way).
_WEIGHT_MAJOR_MAX_ROWS = 64


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the small-row CPU fast path (verify passes of a few to a few dozen rows)."""
    rows = x.numel() // x.shape[-1]
    if not 2 <= rows <= _WEIGHT_MAJOR_MAX_ROWS or x.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


def _decoder_forward(target: HFTarget, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                     logits_rows, input_embeds, *, write_cache: bool) -> TargetOutput:
    # The body of ``HFTarget.forward`` / ``forward_with_grad``: identical arithmetic, only the cache
    # handling differs (scratch write vs read-only concatenation).
    m = target._decoder()
    x = m.embed_tokens(input_ids) if input_embeds is None else input_embeds.to(target.dtype)  # [B, T, d]
    B, T, _ = x.shape
    if cache is None:
        past = 0
    else:
        past = cache.reserve(T) if write_cache else cache.length
    S = past + T
    if position_ids is None:
        position_ids = torch.arange(past, S, device=x.device)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0).expand(B, T)
    cos_t, sin_t = target._rope_tables(int(position_ids.max()) + 1, x)
    cos, sin = cos_t[position_ids].unsqueeze(1), sin_t[position_ids].unsqueeze(1)  # [B, 1, T, hd]

    if attn_mask is None:
        # Plain causal over the new rows; a single row needs no mask at all.
        mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=x.device).tril(past)
    else:
        if attn_mask.shape[-2:] != (T, S):
            raise ValueError(f"attn_mask must be [.., {T}, {S}] (new rows x (past + new)), got {tuple(attn_mask.shape)}")
        mask = attn_mask
    if mask is not None:
        mask = mask.view(-1, 1, T, S)  # [B|1, 1, T, S]

    g = target.geometry
    H, Hkv, hd, d = g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size
    want_aux = return_aux and bool(target.aux_layer_ids)
    capture_in = set(target.aux_layer_ids) if target.layer_convention is LayerConvention.INPUT_TO else set()
    capture_out = set(target.aux_layer_ids) if target.layer_convention is LayerConvention.OUTPUT_OF else set()
    captured: dict[int, torch.Tensor] = {}
    for li, w in enumerate(target._layers):
        if want_aux and li in capture_in:
            captured[li] = x
        h = F.rms_norm(x, (d,), w["ln1"], w["eps1"])
        q, k, v = _linear(h, w["wqkv"], w["bqkv"]).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        if w["q_norm"] is not None:  # qwen3 normalises q/k per head before RoPE
            q, k = w["q_norm"](q), w["k_norm"](k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None and write_cache:
            k, v = cache.write(li, past, k, v)  # [B, Hkv, S, hd]
        elif cache is not None:
            k = torch.cat([cache.k[li, :, :, :past], k], dim=2)  # [B, Hkv, S, hd]
            v = torch.cat([cache.v[li, :, :, :past], v], dim=2)  # [B, Hkv, S, hd]
        if T <= _GROUPED_ATTENTION_MAX_ROWS:
            o = grouped_attention(q, k, v, mask, w["scaling"])  # [B, H, T, hd]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w["scaling"], enable_gqa=Hkv != H)
        x = x + _linear(o.transpose(1, 2).reshape(B, T, H * hd), w["wo"], w["bo"])
        gate, up = _linear(F.rms_norm(x, (d,), w["ln2"], w["eps2"]), w["wgu"]).chunk(2, dim=-1)
        x = x + _linear(w["act"](gate) * up, w["wd"])
        if want_aux and li in capture_out:
            captured[li] = x
    aux = torch.cat([captured[i] for i in target.aux_layer_ids], dim=-1) if want_aux else None  # [B, T, 3d]
    # The final hidden state of every row when asked for (offline features), independent of which
    # rows need logits (an empty ``logits_rows`` skips the LM head entirely).
    last = m.norm(x) if return_last_hidden else None  # [B, T, d]
    if logits_rows is None:
        hidden = last if last is not None else m.norm(x)  # [B, T, d]
    else:
        hidden = last[:, logits_rows] if last is not None else m.norm(x[:, logits_rows])  # [B, R, d]
    if target._lm_head_t is not None and hidden.shape[0] * hidden.shape[1] == 1:
        logits = hidden @ target._lm_head_t  # [1, 1, V]
    else:
        head = target.model.lm_head
        logits = _linear(hidden, head.weight, head.bias)  # [B, T|R, V]
    return TargetOutput(logits=logits, aux_hidden=aux, last_hidden=last)
