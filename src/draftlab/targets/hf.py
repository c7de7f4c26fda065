"""Backend ``hf``: a frozen transformers causal LM with an explicit-cache, explicit-mask forward.

Any causal LM loads through transformers (local path, hub id, or a draftlab asset), so tokenizer, chat
template and HF ``generate`` are always available. The speculative-decoding forward — explicit KV cache,
explicit position ids, an arbitrary [T, S] attention mask for tree verification, auxiliary hidden-state
capture — is a short re-statement of the decoder stack that calls the HF model's own sub-modules (norms,
projections, MLP, rotary embedding), so it shares every weight and numeric detail with HF and only
replaces the cache/mask plumbing. It covers the Llama family (llama, mistral, qwen2, qwen3); other
architectures load but raise a clear error when this forward is asked of them.

The decoder layer is stated once (``_decoder_layer``). ``forward`` is embed -> layers [0, L) -> norm / LM
head; ``forward_layers`` runs any range [a, b) with K/V at explicit cache slots and an optional sparse read
view, for self-speculative drafters that run the target's own layers. A layer's attention (grouped kernels,
masks, pinned rows, sparse views, attention mass) is in ``targets/attention.py``; compiled passes in ``compiled.py``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.assets import cache_root
from draftlab.targets.attention import (
    PassRows,
    grouped_attention,
    grouped_probs,
    layer_keys,
    layer_mask,
    layer_mass,
    pass_mask,
    pinned_rows_mask,
)
from draftlab.targets.base import (
    Geometry,
    LayerConvention,
    LayerOutput,
    PassRequest,
    TargetOutput,
    default_aux_layer_ids,
)
from draftlab.targets.cache import KVCache, SparseView
from draftlab.targets.compiled import MODES as COMPILE_MODES
from draftlab.targets.compiled import PAD_SLOTS, CompiledPasses
from draftlab.targets.compiled import resolve_mode as resolve_compile
from draftlab.targets.fused import cpu_head_pays, fuse_layers, placement
from draftlab.targets.layer_math import layer_output, layer_projections
from draftlab.targets.row_kernels import GEMM, MODES, ROW_GRID, RowKernels
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


# Above this many query rows the fused SDPA kernel wins (prefill).
_GROUPED_ATTENTION_MAX_ROWS = 128



def geometry_of_config(cfg) -> Geometry:
    """The ``Geometry`` of a model with HF config ``cfg`` (a ``transformers.PretrainedConfig``): what a loaded
    target reports, known before (or without) loading its weights."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Geometry(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=head_dim,
        vocab_size=cfg.vocab_size, intermediate_size=getattr(cfg, "intermediate_size", 0),
        model_type=cfg.model_type,
    )


class HFTarget:
    """A frozen HF causal LM exposing the ``Target`` protocol."""

    def __init__(self, model, tokenizer, *, aux_layer_ids: list[int] | None = None,
                 layer_convention: LayerConvention | str = LayerConvention.OUTPUT_OF, name: str | None = None,
                 row_kernels: str = "auto", compile: str = "off"):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "target")
        self.geometry = geometry_of_config(model.config)
        self.layer_convention = LayerConvention(layer_convention)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(
            self.geometry.num_layers, self.layer_convention)
        self._check_aux_ids()
        self.eos_token_ids = self._eos_ids()
        # Module handles resolved once: ``get_input_embeddings()`` costs ~10 us a call, a visible share of a
        # small model's decode step.
        self._embed_tokens = model.get_input_embeddings()
        self._norm = getattr(getattr(model, "model", None), "norm", None)
        # The product for passes of 2..64 rows (verify passes): ``auto`` measures it on this machine at the
        # first such pass (cached per machine), ``gemm`` / ``weight_major`` force one (targets/row_kernels.py).
        if row_kernels not in MODES:
            raise ValueError(f"row_kernels must be one of {MODES}, got {row_kernels!r}")
        self.row_kernels_mode = row_kernels
        # Decode and verify passes through torch.compile (targets/compiled.py): off | auto | on.
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.compile_mode = compile
        self._refresh()

    def to(self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> HFTarget:
        """Move and/or cast the model; what is built from its weights follows. Returns ``self``.

        ``target.model.to(...)`` alone works too: the next forward notices the move and fuses again."""
        self.model.to(device=device, dtype=None if dtype is None else resolve_dtype(dtype))
        self._refresh()
        return self

    def _refresh(self) -> None:
        """(Re)build what depends on where the weights are: fused matrices (fused.py), rotary tables, the
        CPU LM-head copy and the row kernels (measured per device and dtype)."""
        fusable = self.geometry.model_type in SUPPORTED_MODEL_TYPES
        # The module whose weight tells where the model is now (a fused one: its view is what a move replaces).
        self._probe = self.model.model.layers[0].self_attn.q_proj if fusable else self._embed_tokens
        head = getattr(self.model, "lm_head", None)
        if getattr(self.model.config, "tie_word_embeddings", False) and head is not None \
                and head.weight is not self._embed_tokens.weight:
            self.model.tie_weights()  # a move that replaces parameters (e.g. to meta) unties them
        self._layers = fuse_layers(self.model) if fusable else None
        self._fused_on = placement(self._probe.weight)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos/sin tables [P, hd]
        self._lm_head_t: torch.Tensor | None = None  # [d, V], made by the first single-row CPU product
        self._row_kernels: RowKernels | None = None
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        on = resolve_compile(self.compile_mode, device=self._probe.weight.device, weight_bytes=weight_bytes,
                             supported=fusable and self._probe.weight.device.type != "meta")
        self._compiled = CompiledPasses(self) if on else None

    def set_compile(self, mode: str) -> HFTarget:
        """Switch the compiled passes ``off`` / ``auto`` / ``on`` in place (the weights stay as they are): for
        measuring both engines on one loaded model. Returns ``self``."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        self.compile_mode = mode
        self._refresh()
        return self

    @property
    def compiled(self) -> bool:
        """Whether decode and verify passes run through the compiled graphs (``compile`` resolved)."""
        return self._compiled is not None

    def compile_stats(self) -> dict:
        """The ``engine`` block of a run record: the compile setting, what compiling cost, recompiles."""
        stats = self._compiled.stats.as_dict() if self._compiled is not None else {}
        return {"compile": self.compile_mode, "compiled": self.compiled, **stats}

    def _follow_model(self) -> None:
        # A few hundred ns per pass: the model was moved or cast behind the target's back (``model.to``).
        if placement(self._probe.weight) != self._fused_on:
            self._refresh()

    @property
    def row_kernels(self) -> RowKernels:
        """The small-row product of verify passes (``auto``: measured on whole passes at first use, cached)."""
        if self._row_kernels is None:
            mode = self.row_kernels_mode
            if mode != "auto" or self.device.type != "cpu" or self._layers is None:
                self._row_kernels = RowKernels(GEMM if mode == "auto" else mode)
                return self._row_kernels
            from draftlab.targets.probe import verify_passes

            self._row_kernels = RowKernels(GEMM)  # what the measurement's own prefill runs with
            passes: dict[int, object] = {}

            def run(rows: int, kernels: RowKernels) -> None:
                if not passes:
                    passes.update(zip(ROW_GRID, verify_passes(self, ROW_GRID, context=64)))
                self._row_kernels = kernels
                passes[rows]()

            identity = {"target": self.name, "dtype": str(self.dtype), "geometry": asdict(self.geometry)}
            measured = RowKernels.measured(run, identity, cache_dir=cache_root())
            self._row_kernels = measured
        return self._row_kernels

    @row_kernels.setter
    def row_kernels(self, kernels: RowKernels) -> None:
        """A given table instead of the measured one (tests pin one, so outputs never depend on timing)."""
        self._row_kernels = kernels

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
        self.check_layer_ids(self.aux_layer_ids)

    def check_layer_ids(self, ids) -> list[int]:
        """``ids`` as a list of ints, or ``ValueError`` when one is not a layer of this target."""
        L = self.geometry.num_layers
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i <= L - 1]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range [0, {L - 1}] for a {L}-layer target "
                             f"under the '{self.layer_convention.value}' convention")
        return ids

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        g = self.geometry
        if self._compiled is not None:
            max_length += PAD_SLOTS  # room for a compiled pass's pad rows (row buckets) after the last real one
        return KVCache(g.num_layers, batch_size, g.num_kv_heads, g.head_dim, max_length,
                       dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------------------------------------
    # forward

    def _decoder(self):
        if self.geometry.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"the explicit-cache forward supports {SUPPORTED_MODEL_TYPES}; '{self.geometry.model_type}' "
                "loads (tokenizer, HF generate) but cannot be verified against yet")
        self._follow_model()
        return self.model.model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                request: PassRequest | None = None) -> TargetOutput:
        """Run the target on T new rows.

        input_ids    [B, T]; or None with ``request.input_embeds [B, T, d]`` for rows that are not tokens.
        position_ids [B, T] or [T]; default ``past + arange(T)`` (trees pass ``past + depth``).
        cache        the rows are written to the cache's scratch slots and attend to ``[0, past + T)``;
                     ``cache.commit*`` decides what stays. Without a cache the rows attend only to each other.
        attn_mask    bool [B, T, S] or [T, S] with S = past + T (True = may attend); default causal.
        request      what else the pass computes (``PassRequest``): aux taps (methods pass the layers they
                     tap, so taps are a method setting), the rows that need logits, final hidden states,
                     pinned rows (keys computed once, e.g. soft prompts) and the attention mass of the last
                     W rows (a pass of a few rows reads it off its own softmax; a long pass, fused SDPA,
                     scores the W rows again).
        """
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, request, write_cache=True)

    def forward_with_grad(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                          request: PassRequest | None = None) -> TargetOutput:
        """``forward`` under the caller's grad mode, differentiable w.r.t. ``request.input_embeds`` (the
        weights stay frozen).

        The cache is only read: the new rows attend to its committed slots ``[0, cache.length)`` (as stored,
        hence constant for autograd) and to each other, and nothing is written to it. Writing grad-carrying
        keys into the shared cache buffer would let a later layer's write invalidate an earlier layer's
        saved tensors, so the keys of each layer are concatenated instead.
        """
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, request, write_cache=False)

    # ------------------------------------------------------------------------------------------------
    # pieces of the forward, for drafters that run the target's own layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``ids [B, T] -> [B, T, d]`` (under the caller's grad mode)."""
        return self._embed_tokens(ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm applied before the LM head, ``[..., d] -> [..., d]``."""
        if self._norm is None:
            self._decoder()  # explains which architectures are supported
        return self._norm(h)

    def lm_head(self, h: torch.Tensor, *, norm: bool = True) -> torch.Tensor:
        """Logits of hidden states ``h [B, T, d]`` -> ``[B, T, V]``; ``norm`` applies the final norm first.

        ``h`` is the raw residual stream (``forward_layers`` output) when ``norm`` is True, an already
        normalised state otherwise. Under the caller's grad mode; under ``no_grad`` (as drafters run) it takes
        the same CPU fast paths as ``forward`` and is bit-identical to its head, with grad it is plain F.linear.
        """
        if norm:
            h = self.final_norm(h)
        head = self.model.lm_head
        if h.numel() == h.shape[-1] and h.device.type == "cpu" and self._layers is not None:
            self._follow_model()
            if self._lm_head_t is None and cpu_head_pays(self.model, head.weight):
                self._lm_head_t = head.weight.detach().t().contiguous()  # [d, V]: see fused.cpu_head_pays
            if self._lm_head_t is not None:
                return h @ self._lm_head_t  # [1, 1, V]
        return self.row_kernels.linear(h, head.weight, head.bias)  # [B, T, V]

    @torch.no_grad()
    def forward_layers(self, hidden: torch.Tensor, start: int, end: int, *, position_ids: torch.Tensor | None = None,
                       cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                       slots: torch.Tensor | list[int] | None = None, view: SparseView | None = None,
                       aux_layer_ids: list[int] | None = None) -> LayerOutput:
        """Run decoder layers ``[start, end)`` on hidden states ``hidden [B, T, d]`` (the residual stream).

        ``forward`` is ``embed`` -> ``forward_layers(0, L)`` -> ``lm_head``; composing ranges reproduces it.
        position_ids [T] or [B, T]; default: the rows' slots.
        cache        the rows' K/V are written to layers ``[start, end)`` only, at ``slots [T]`` (distinct;
                     default ``cache.length + arange(T)``, the scratch slots). Lengths do not change: keep
                     rows with ``cache.commit*`` / ``cache.commit_layers``. Without a cache the rows attend
                     only to each other.
        attn_mask    bool [B, T, S] or [T, S] over cache slots ``[0, S)``, S = max slot + 1 (True = may attend).
                     Default: each layer's committed rows ``[0, layer_length)`` plus the rows, causally.
        view         a ``SparseView``: at its layers each KV head reads only its listed slots plus the rows
                     themselves (``attn_mask`` still applies at the listed slots).
        aux_layer_ids  layers in ``[start, end)`` (``self.layer_convention``) whose hidden states to return
                     as ``aux [B, T, n * d]``; default none.
        """
        self._decoder()
        L = self.geometry.num_layers
        if not 0 <= start <= end <= L:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {L}]")
        if view is not None and cache is None:
            raise ValueError("a sparse view reads a cache: pass cache=")
        taps = self.check_layer_ids(aux_layer_ids) if aux_layer_ids is not None else []
        outside = [i for i in taps if not start <= i < end]
        if outside:
            raise ValueError(f"aux layer ids {outside} are not computed by layers [{start}, {end})")
        x = hidden.to(self.dtype)  # [B, T, d]
        if self._compiled is not None and (start, end) == (0, L) and view is None:  # a draft model's pass
            if (out := self._compiled.layers_pass(x, position_ids, cache, attn_mask, slots, taps)) is not None:
                return out
        r = _prepare(self, x, position_ids, cache, attn_mask, slots, True)
        x, captured = _run_layers(self, x, start, end, r, cache, view, taps)
        aux = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [B, T, n * d]
        return LayerOutput(hidden=x, aux=aux)

    __call__ = forward


def _prepare(target: HFTarget, x: torch.Tensor, position_ids, cache: KVCache | None, attn_mask, slots,
             write: bool, request: PassRequest | None = None) -> PassRows:
    B, T, _ = x.shape
    dev = x.device
    if cache is None:
        if slots is not None:
            raise ValueError("explicit slots need a cache")
        past, S = 0, T
    elif slots is None:
        past = cache.reserve(T) if write else cache.length
        S = past + T
    else:
        slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
        if slots.shape != (T,):
            raise ValueError(f"slots must be [{T}] (one per row), got {tuple(slots.shape)}")
        cache.check_slots(slots)
        past, S = cache.length, int(slots.max()) + 1
    if position_ids is None:
        position_ids = slots if slots is not None else torch.arange(past, S, device=dev)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0).expand(B, T)
    cos_t, sin_t = target._rope_tables(int(position_ids.max()) + 1, x)
    cos, sin = cos_t[position_ids].unsqueeze(1), sin_t[position_ids].unsqueeze(1)  # [B, 1, T, hd]
    per_layer = slots is not None or (write and cache is not None and cache.ragged)
    mask, layer_masks = pass_mask(attn_mask, T, S, past, explicit_slots=slots is not None, per_layer=per_layer,
                                  device=dev)
    pinned = request.pinned if request is not None else None
    pmask = pinned_rows_mask(pinned, request.pinned_mask if request is not None else None,
                             target.geometry.num_layers, B, T, dev)
    return PassRows(cos, sin, past, slots, S, mask, write, layer_masks, pinned, pmask)


def _decoder_layer(target: HFTarget, li: int, x: torch.Tensor, r: PassRows, cache: KVCache | None,
                   idx: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer on rows ``x [B, T, d]``: the only statement of the layer (forward, forward_layers)."""
    w = target._layers[li]
    H, Hkv = target.geometry.num_heads, target.geometry.num_kv_heads
    _linear = target.row_kernels.linear
    q, k, v = layer_projections(target, w, x, r.cos, r.sin, _linear)
    mask = r.mask if r.layer_masks is None else layer_mask(r, cache, li)  # [B|1, 1, T, S] or None
    k, v, mask = layer_keys(cache, li, r, k, v, mask, idx)  # [B, Hkv, S', hd], mask [B|1, 1|Hkv, T, S']
    probs = None
    if x.shape[1] <= _GROUPED_ATTENTION_MAX_ROWS:
        probs = grouped_probs(q, k, mask, w["scaling"])  # [B, Hkv, G, T, S']
        o = grouped_attention(q, k, v, mask, w["scaling"], probs)  # [B, H, T, hd]
    else:
        sdpa_mask = mask
        if mask is not None and mask.shape[1] != 1 and Hkv != H:
            sdpa_mask = mask.repeat_interleave(H // Hkv, dim=1)  # per-KV-head view mask -> [B|1, H, T, K + T]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=w["scaling"], enable_gqa=Hkv != H)
    if r.mass_rows:
        r.masses.append(layer_mass(r, q, k, mask, probs, w["scaling"]))  # [B, Hkv, S]
    return layer_output(target, w, x, o, _linear)


def _run_layers(target: HFTarget, x: torch.Tensor, start: int, end: int, r: PassRows, cache: KVCache | None,
                view: SparseView | None, taps) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Layers [start, end) on ``x [B, T, d]``; captures the hidden states ``taps`` name (layer convention)."""
    capture_in = set(taps) if target.layer_convention is LayerConvention.INPUT_TO else set()
    capture_out = set(taps) if target.layer_convention is LayerConvention.OUTPUT_OF else set()
    captured: dict[int, torch.Tensor] = {}
    for li in range(start, end):
        if li in capture_in:
            captured[li] = x
        x = _decoder_layer(target, li, x, r, cache, None if view is None else view.layer(li))
        if li in capture_out:
            captured[li] = x
    return x, captured


def _decoder_forward(target: HFTarget, input_ids, position_ids, cache, attn_mask, request: PassRequest | None, *,
                     write_cache: bool) -> TargetOutput:
    # The body of ``HFTarget.forward`` / ``forward_with_grad``: embed -> layers [0, L) -> norm / LM head, the
    # same layer code as ``forward_layers``; only the cache handling differs (scratch write vs read-only).
    if isinstance(attn_mask, PassRequest):  # one argument early: easy to write, silently wrong otherwise
        raise TypeError("a PassRequest was passed as attn_mask: pass it as forward(..., request=...)")
    req = request if request is not None else PassRequest()
    target._decoder()
    x = target.embed(input_ids) if req.input_embeds is None else req.input_embeds.to(target.dtype)  # [B, T, d]
    if target._compiled is not None:
        out = target._compiled.forward(x, position_ids, cache, attn_mask, req, write_cache)
        if out is not None:
            return out
    r = _prepare(target, x, position_ids, cache, attn_mask, None, write_cache, req)
    if req.attn_mass_rows:
        if int(req.attn_mass_rows) < 0:
            raise ValueError(f"attn_mass_rows must be a positive number of rows, got {req.attn_mass_rows}")
        r.mass_rows, r.masses = int(req.attn_mass_rows), []
    taps = target.check_layer_ids(req.aux_layer_ids(target.aux_layer_ids))
    x, captured = _run_layers(target, x, 0, target.geometry.num_layers, r, cache, None, taps)
    aux = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [B, T, n_taps * d]
    # The final hidden state of every row when asked for (offline features), independent of which
    # rows need logits (an empty ``logits_rows`` skips the LM head entirely).
    last = target.final_norm(x) if req.last_hidden else None  # [B, T, d]
    rows = req.logits_rows
    if rows is None:
        hidden = last if last is not None else target.final_norm(x)  # [B, T, d]
    else:
        hidden = last[:, rows] if last is not None else target.final_norm(x[:, rows])  # [B, R, d]
    mass = torch.stack(r.masses) if r.mass_rows else None  # [L, B, Hkv, S]
    return TargetOutput(logits=target.lm_head(hidden, norm=False), aux_hidden=aux, last_hidden=last, attn_mass=mass)
