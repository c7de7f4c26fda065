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
view, for self-speculative drafters that run the target's own layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.assets import cache_root
from draftlab.decoding.cache import KVCache, PinnedKV, SparseView
from draftlab.targets.base import Geometry, LayerConvention, LayerOutput, TargetOutput, default_aux_layer_ids
from draftlab.targets.fused import cpu_head_pays, fuse_layers, placement
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


def grouped_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention probabilities of a few query rows, heads grouped onto their shared KV head.

    q [B, H, T, hd], k [B, Hkv, S, hd], mask bool [B|1, 1|Hkv, T, S] or None -> probs [B, Hkv, G, T, S]
    (G = H // Hkv; query head h = kv * G + g). A per-KV-head mask is what a sparse read view needs.
    """
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, hd)  # heads h = kv * G + g share KV head kv
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).view(B, Hkv, G, T, S)  # [B, Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # mask [B|1, 1|Hkv, 1, T, S]
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a few query rows against a long cache: q [B, H, T, hd], k/v [B, Hkv, S, hd] -> [B, H, T, hd].

    On CPU, PyTorch's fused SDPA kernel costs milliseconds per call for T=1 (it is built for long
    queries); two small matmuls cost microseconds. Used for decode steps and verify passes. ``probs``:
    ``grouped_probs`` already computed by the caller (who also reads them).
    """
    B, H, T, hd = q.shape
    Hkv, S = v.shape[1], v.shape[2]
    if probs is None:
        probs = grouped_probs(q, k, mask, scale)
    return torch.matmul(probs.view(B, Hkv, (H // Hkv) * T, S), v).view(B, H, T, hd)


def attention_mass(probs: torch.Tensor, rows: int) -> torch.Tensor:
    """Mass the last ``rows`` query rows put on each key, summed over those rows and each KV head's query
    heads: probs [B, Hkv, G, T, S] -> [B, Hkv, S] (float32). What a sparse-KV drafter ranks slots by."""
    return probs[:, :, :, -rows:].sum(dim=(2, 3), dtype=torch.float32)


# Above this many query rows the fused SDPA kernel wins (prefill).
_GROUPED_ATTENTION_MAX_ROWS = 128


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class HFTarget:
    """A frozen HF causal LM exposing the ``Target`` protocol."""

    def __init__(self, model, tokenizer, *, aux_layer_ids: list[int] | None = None,
                 layer_convention: LayerConvention | str = LayerConvention.OUTPUT_OF, name: str | None = None,
                 row_kernels: str = "auto"):
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
        # Module handles resolved once: ``get_input_embeddings()`` costs ~10 us a call, a visible share of a
        # small model's decode step.
        self._embed_tokens = model.get_input_embeddings()
        self._norm = getattr(getattr(model, "model", None), "norm", None)
        # The product for passes of 2..64 rows (verify passes): ``auto`` measures it on this machine at the
        # first such pass (cached per machine), ``gemm`` / ``weight_major`` force one (targets/row_kernels.py).
        if row_kernels not in MODES:
            raise ValueError(f"row_kernels must be one of {MODES}, got {row_kernels!r}")
        self.row_kernels_mode = row_kernels
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
            from draftlab.decoding.cost import verify_passes

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
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None, *,
                return_aux: bool = False, return_last_hidden: bool = False,
                logits_rows: torch.Tensor | None = None, input_embeds: torch.Tensor | None = None,
                aux_layer_ids: list[int] | None = None, pinned: PinnedKV | None = None,
                pinned_mask: torch.Tensor | None = None, attn_mass_rows: int | None = None) -> TargetOutput:
        """Run the target on T new rows.

        input_ids    [B, T]; or ``input_embeds [B, T, d]`` for rows that are not vocabulary tokens.
        position_ids [B, T] or [T]; default ``past + arange(T)`` (trees pass ``past + depth``).
        cache        the rows are written to the cache's scratch slots and attend to ``[0, past + T)``;
                     ``cache.commit*`` decides what stays. Without a cache the rows attend only to each other.
        attn_mask    bool [B, T, S] or [T, S] with S = past + T (True = may attend); default causal.
        logits_rows  optional [R] indices of rows whose logits are needed (saves the LM head elsewhere).
        aux_layer_ids  the layers to capture when ``return_aux`` (in ``self.layer_convention``); default
                     ``self.aux_layer_ids``. Methods pass the layers they tap, so taps are a method setting.
        pinned       ``PinnedKV`` rows every layer may also attend to (keys computed once, e.g. soft prompts);
                     ``pinned_mask`` bool [B|1, T, P] or [T, P] says which row sees which (default: all).
        attn_mass_rows  W: also return ``attn_mass [L, B, Hkv, S]``, the attention probability the last W
                     rows put on each of the S = past + T slots at every layer, summed over those rows and
                     over each KV head's query heads (the importance signal of sparse-KV drafting). A pass of
                     a few rows reads it off its own softmax; a long pass (fused SDPA) scores the W rows again.
        """
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                                logits_rows, input_embeds, write_cache=True, aux_layer_ids=aux_layer_ids,
                                pinned=pinned, pinned_mask=pinned_mask, attn_mass_rows=attn_mass_rows)

    def forward_with_grad(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          cache: KVCache | None = None, attn_mask: torch.Tensor | None = None, *,
                          return_aux: bool = False, return_last_hidden: bool = False,
                          logits_rows: torch.Tensor | None = None,
                          input_embeds: torch.Tensor | None = None,
                          aux_layer_ids: list[int] | None = None, pinned: PinnedKV | None = None,
                          pinned_mask: torch.Tensor | None = None, attn_mass_rows: int | None = None) -> TargetOutput:
        """``forward`` under the caller's grad mode, differentiable w.r.t. ``input_embeds`` (the weights stay frozen).

        The cache is only read: the new rows attend to its committed slots ``[0, cache.length)`` (as stored,
        hence constant for autograd) and to each other, and nothing is written to it. Writing grad-carrying
        keys into the shared cache buffer would let a later layer's write invalidate an earlier layer's
        saved tensors, so the keys of each layer are concatenated instead.
        """
        return _decoder_forward(self, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                                logits_rows, input_embeds, write_cache=False, aux_layer_ids=aux_layer_ids,
                                pinned=pinned, pinned_mask=pinned_mask, attn_mass_rows=attn_mass_rows)

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
        r = _prepare(self, x, position_ids, cache, attn_mask, slots, True)
        x, captured = _run_layers(self, x, start, end, r, cache, view, taps)
        aux = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [B, T, n * d]
        return LayerOutput(hidden=x, aux=aux)

    __call__ = forward


@dataclass
class _Rows:
    """What every layer of one pass shares: the rows' rotary tables, cache slots and attention mask."""

    cos: torch.Tensor  # [B, 1, T, hd]
    sin: torch.Tensor  # [B, 1, T, hd]
    past: int  # first slot of the rows when they are contiguous (``slots is None``)
    slots: torch.Tensor | None  # [T] explicit cache slots of the rows
    S: int  # the rows attend to cache slots [0, S)
    mask: torch.Tensor | None  # bool [B|1, 1, T, S]; None: all of [0, S) (a single decode row)
    write: bool  # write K/V into the cache (forward) or only read it (forward_with_grad)
    # Default mask on a cache whose layers have different lengths: one mask per committed length.
    layer_masks: dict[int, torch.Tensor] | None = None
    pinned: PinnedKV | None = None  # rows outside the cache that every layer may also read
    pinned_mask: torch.Tensor | None = None  # bool [B|1, 1, T, P]
    mass_rows: int = 0  # > 0: collect each layer's attention mass of the last ``mass_rows`` rows
    masses: list[torch.Tensor] | None = None  # per layer [B, Hkv, S], filled by ``_decoder_layer``

    def row_slots(self, device: torch.device) -> torch.Tensor:
        T = self.cos.shape[2]
        return self.slots if self.slots is not None else torch.arange(self.past, self.past + T, device=device)


def _default_mask(T: int, S: int, committed: int, slots: torch.Tensor) -> torch.Tensor:
    """Causal over committed + own rows: row t sees slots [0, committed) and the rows 0..t at ``slots [T]``."""
    m = torch.zeros(T, S, dtype=torch.bool, device=slots.device)  # [T, S]
    m[:, :committed] = True
    # Own slots below ``committed`` are rows of this pass, not context: causal among the rows only.
    m[:, slots] = torch.ones(T, T, dtype=torch.bool, device=slots.device).tril()
    return m.view(1, 1, T, S)


def _prepare(target: HFTarget, x: torch.Tensor, position_ids, cache: KVCache | None, attn_mask, slots,
             write: bool, pinned: PinnedKV | None = None, pinned_mask: torch.Tensor | None = None) -> _Rows:
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

    layer_masks = None
    if attn_mask is not None:
        if attn_mask.shape[-2:] != (T, S):
            what = "new rows x (past + new)" if slots is None else "new rows x (max slot + 1)"
            raise ValueError(f"attn_mask must be [.., {T}, {S}] ({what}), got {tuple(attn_mask.shape)}")
        mask = attn_mask.view(-1, 1, T, S)  # [B|1, 1, T, S]
    elif slots is None and not (write and cache is not None and cache.ragged):
        # Plain causal over the new rows; a single row needs no mask at all.
        mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=dev).tril(past).view(1, 1, T, S)
    else:
        mask, layer_masks = None, {}  # depends on each layer's committed length: built on first use
    pmask = None
    if pinned is not None:
        P = pinned.num_rows
        if pinned.k.shape[0] != target.geometry.num_layers or pinned.k.shape[1] not in (1, B):
            raise ValueError(f"pinned keys {tuple(pinned.k.shape)} do not fit a {target.geometry.num_layers}-layer "
                             f"target and batch {B} ([L, 1|B, Hkv, P, hd])")
        if pinned_mask is None:
            pmask = torch.ones(1, 1, T, P, dtype=torch.bool, device=dev)
        elif pinned_mask.shape[-2:] != (T, P):
            raise ValueError(f"pinned_mask must be [.., {T}, {P}] (new rows x pinned rows), got "
                             f"{tuple(pinned_mask.shape)}")
        else:
            pmask = pinned_mask.to(device=dev, dtype=torch.bool).view(-1, 1, T, P)
    elif pinned_mask is not None:
        raise ValueError("pinned_mask without pinned keys")
    return _Rows(cos, sin, past, slots, S, mask, write, layer_masks, pinned, pmask)


def _layer_mask(r: _Rows, cache: KVCache, li: int) -> torch.Tensor:
    # Rows a layer holds beyond ``S`` (later provisional rows) are never visible to this pass.
    c = min(cache.layer_length(li), r.S)
    m = r.layer_masks.get(c)
    if m is None:
        m = r.layer_masks[c] = _default_mask(r.cos.shape[2], r.S, c, r.row_slots(r.cos.device))
    return m


def _decoder_layer(target: HFTarget, li: int, x: torch.Tensor, r: _Rows, cache: KVCache | None,
                   idx: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer on rows ``x [B, T, d]``: the only statement of the layer (forward, forward_layers)."""
    w = target._layers[li]
    g = target.geometry
    H, Hkv, hd, d = g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size
    B, T, _ = x.shape
    _linear = target.row_kernels.linear
    h = F.rms_norm(x, (d,), w["ln1"], w["eps1"])
    q, k, v = _linear(h, w["wqkv"], w["bqkv"]).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
    k = k.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
    v = v.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
    if w["q_norm"] is not None:  # qwen3 normalises q/k per head before RoPE
        q, k = w["q_norm"](q), w["k_norm"](k)
    q = q * r.cos + _rotate_half(q) * r.sin
    k = k * r.cos + _rotate_half(k) * r.sin
    mask = r.mask if r.layer_masks is None else _layer_mask(r, cache, li)  # [B|1, 1, T, S] or None
    if idx is not None:
        k, v, mask = _sparse_keys(cache, li, r, k, v, mask, idx)  # [B, Hkv, K + T, hd], mask [B|1, Hkv, T, K + T]
    elif cache is not None and r.write:
        if r.slots is None:
            k, v = cache.write(li, r.past, k, v)  # [B, Hkv, S, hd]
        else:
            cache.write_at(li, r.slots, k, v)
            k, v = cache.k[li, :, :, :r.S], cache.v[li, :, :, :r.S]  # [B, Hkv, S, hd]
    elif cache is not None:
        k = torch.cat([cache.k[li, :, :, :r.past], k], dim=2)  # [B, Hkv, S, hd]
        v = torch.cat([cache.v[li, :, :, :r.past], v], dim=2)  # [B, Hkv, S, hd]
    if r.pinned is not None:
        k, v, mask = _with_pinned(r, li, k, v, mask)  # [B, Hkv, P + S', hd], mask [B|1, 1|Hkv, T, P + S']
    probs = None
    if T <= _GROUPED_ATTENTION_MAX_ROWS:
        probs = grouped_probs(q, k, mask, w["scaling"])  # [B, Hkv, G, T, S']
        o = grouped_attention(q, k, v, mask, w["scaling"], probs)  # [B, H, T, hd]
    else:
        sdpa_mask = mask
        if mask is not None and mask.shape[1] != 1 and Hkv != H:
            sdpa_mask = mask.repeat_interleave(H // Hkv, dim=1)  # per-KV-head view mask -> [B|1, H, T, K + T]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=w["scaling"], enable_gqa=Hkv != H)
    if r.mass_rows:
        r.masses.append(_layer_mass(r, q, k, mask, probs, w["scaling"]))  # [B, Hkv, S]
    x = x + _linear(o.transpose(1, 2).reshape(B, T, H * hd), w["wo"], w["bo"])
    gate, up = _linear(F.rms_norm(x, (d,), w["ln2"], w["eps2"]), w["wgu"]).chunk(2, dim=-1)
    return x + _linear(w["act"](gate) * up, w["wd"])


def _layer_mass(r: _Rows, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, probs: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """``attention_mass`` of the last ``r.mass_rows`` rows over cache slots [0, S) -> [B, Hkv, S].

    ``probs`` of a grouped pass are reused; after fused SDPA (a long prefill) only the W rows are scored
    again, a W x S product per head. Pinned rows sit in front of the keys and are left out.
    """
    W = min(r.mass_rows, q.shape[2])
    if probs is None:
        rows_mask = None if mask is None else mask[..., -W:, :]  # [B|1, 1|Hkv, W, S']
        probs = grouped_probs(q[:, :, -W:], k, rows_mask, scale)  # [B, Hkv, G, W, S']
    mass = attention_mass(probs, W)  # [B, Hkv, S']
    return mass[..., mass.shape[-1] - r.S:]  # drop pinned columns: [B, Hkv, S]


def _with_pinned(r: _Rows, li: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Pinned rows' keys/values in front of the pass's own keys ``k/v [B, Hkv, S, hd]``, the mask widened."""
    B, _, S, _ = k.shape
    pk = r.pinned.k[li].to(k.dtype).expand(B, -1, -1, -1)  # [B, Hkv, P, hd]
    pv = r.pinned.v[li].to(v.dtype).expand(B, -1, -1, -1)
    T, P = r.cos.shape[2], pk.shape[2]
    if mask is None:
        mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=k.device)
    bm, hm = max(mask.shape[0], r.pinned_mask.shape[0]), mask.shape[1]
    mask = torch.cat([r.pinned_mask.expand(bm, hm, T, P), mask.expand(bm, hm, T, S)], dim=-1)
    return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), mask


def _sparse_keys(cache: KVCache, li: int, r: _Rows, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 idx: torch.Tensor):
    """Keys/values of a sparse read: the view's slots of each KV head, then the rows' own K/V.

    k/v [B, Hkv, T, hd] (the rows, after RoPE); idx [Hkv, K]. The rows' own slots are read from ``k/v``
    rather than the cache, so the same code serves the read-only (grad) pass.
    """
    T = k.shape[2]
    own_slots = r.row_slots(k.device)  # [T]
    if r.write:
        if r.slots is None:
            cache.write(li, r.past, k, v)
        else:
            cache.write_at(li, r.slots, k, v)
        readable = r.S
    else:
        readable = r.past  # the grad pass sees only committed slots
    if idx.numel() and int(idx.max()) >= readable:
        raise ValueError(f"sparse view of layer {li} reads slot {int(idx.max())}, beyond the {readable} readable")
    idx = idx.to(k.device)
    ks = SparseView.gather(idx, cache.k[li, :, :, :readable])  # [B, Hkv, K, hd]
    vs = SparseView.gather(idx, cache.v[li, :, :, :readable])  # [B, Hkv, K, hd]
    if mask is None:
        mask = torch.ones(1, 1, T, r.S, dtype=torch.bool, device=k.device)  # [1, 1, T, S]
    own = torch.zeros(r.S, dtype=torch.bool, device=k.device)  # [S]
    own[own_slots] = True
    m_view = SparseView.gather_mask(idx, mask, own)  # [B|1, Hkv, T, K]
    m_rows = mask[..., own_slots].expand(-1, idx.shape[0], -1, -1)  # [B|1, Hkv, T, T]
    return (torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2),  # [B, Hkv, K + T, hd]
            torch.cat([m_view, m_rows], dim=-1))  # [B|1, Hkv, T, K + T]


def _run_layers(target: HFTarget, x: torch.Tensor, start: int, end: int, r: _Rows, cache: KVCache | None,
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


def _decoder_forward(target: HFTarget, input_ids, position_ids, cache, attn_mask, return_aux, return_last_hidden,
                     logits_rows, input_embeds, *, write_cache: bool,
                     aux_layer_ids: list[int] | None = None, pinned: PinnedKV | None = None,
                     pinned_mask: torch.Tensor | None = None, attn_mass_rows: int | None = None) -> TargetOutput:
    # The body of ``HFTarget.forward`` / ``forward_with_grad``: embed -> layers [0, L) -> norm / LM head, the
    # same layer code as ``forward_layers``; only the cache handling differs (scratch write vs read-only).
    target._decoder()
    x = target.embed(input_ids) if input_embeds is None else input_embeds.to(target.dtype)  # [B, T, d]
    r = _prepare(target, x, position_ids, cache, attn_mask, None, write_cache, pinned, pinned_mask)
    if attn_mass_rows:
        if int(attn_mass_rows) < 0:
            raise ValueError(f"attn_mass_rows must be a positive number of rows, got {attn_mass_rows}")
        r.mass_rows, r.masses = int(attn_mass_rows), []
    taps = target.check_layer_ids(aux_layer_ids) if aux_layer_ids is not None else target.aux_layer_ids
    want_aux = return_aux and bool(taps)
    x, captured = _run_layers(target, x, 0, target.geometry.num_layers, r, cache, None, taps if want_aux else ())
    aux = torch.cat([captured[i] for i in taps], dim=-1) if want_aux else None  # [B, T, n_taps * d]
    # The final hidden state of every row when asked for (offline features), independent of which
    # rows need logits (an empty ``logits_rows`` skips the LM head entirely).
    last = target.final_norm(x) if return_last_hidden else None  # [B, T, d]
    if logits_rows is None:
        hidden = last if last is not None else target.final_norm(x)  # [B, T, d]
    else:
        hidden = last[:, logits_rows] if last is not None else target.final_norm(x[:, logits_rows])  # [B, R, d]
    mass = torch.stack(r.masses) if r.mass_rows else None  # [L, B, Hkv, S]
    return TargetOutput(logits=target.lm_head(hidden, norm=False), aux_hidden=aux, last_hidden=last, attn_mass=mass)
