"""Compiled decode and verify passes of ``HFTarget`` (``engine.compile: off | auto | on``).

Eager PyTorch leaves most of a CPU's memory bandwidth unused on a batch-1 step: MKL's ``x @ W.T`` streams
SmolLM2's 0.54 GB of fp32 weights at ~11 GB/s for one row and slower for two, where the machine reads
~28 GB/s. The step is a matrix-vector product per weight, bound by reading the weights once, so the
compiled pass states it as one: ``(W[:, None, :] * x[None]).sum(-1)`` (``row_product``), which inductor
turns into a vectorised loop over W's rows that reads each row once for all the pass's rows (all 30
layers' products: 1 row 16 ms, 8 rows 29 ms, against 45 ms and 58 ms for ``F.linear``, measured in
experiments/engine_baseline part f). Passes of several rows in bf16 call oneDNN's GEMM on weights reordered
once into its blocked layout (``targets/packed_linear.py``), flat from 1 to 8 rows where the CPU has bf16
instructions. On a GPU the same compile fuses the pass's many small kernels.

How the passes are compiled, gpt-fast style:

- **one graph per row bucket, shared by every layer**: a pass of T rows is padded to the next bucket (1, 2,
  4, ..., 64), and one decoder layer is compiled with its weights as inputs, so the 30 layers of SmolLM2
  run one graph (compile time is one layer's, not the model's). Pad rows write K/V into scratch slots past
  the real rows (never committed: the next pass overwrites scratch) and see only slot 0, so they cannot
  disturb a real row; their outputs are dropped.
- **the cache stays where it is**: K/V are written in place at the rows' slots (``index_copy_``) and the
  pass attends to slots ``[0, S)``; S and the cache's length are dynamic dimensions (``mark_dynamic``), so
  one graph serves every step of every sequence.
- **what stays eager**: prefill (the pass into an empty cache, usually long: where fused SDPA and GEMM are the right kernels), passes the
  graphs do not cover (pinned rows, attention mass, explicit slots, ragged caches, batches > 1, more rows
  than the last bucket, gradients) and the layer-range passes of self-speculative drafters. A draft model's
  passes over all layers (``forward_layers(0, L)``, explicit slots) compile when their rows fill a bucket. Every eager
  path is unchanged; the record counts how many passes took each road.

The layer's math is ``layer_math.layer_projections`` / ``layer_output``, the functions the eager forward runs
(``static_layer``); only the product, the cache writes and the mask plumbing differ. In fp32 a compiled pass sums in a
different order than the eager one (logits agree to ~1e-5), as a verify pass of T rows already does
against an AR step: the engine's guarantee is unchanged (what it emits is what its passes' argmax or
distributions say), and tests check compiled == eager == AR token for token.

Compiles are counted and timed by the backend wrapper (``CompileStats``): a graph compiled more than once
for one bucket is a *recompile*, logged and written to the run record, so a pass that silently recompiles
every round shows up there.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftlab.targets.attention import grouped_attention
from draftlab.targets.layer_math import layer_output, layer_projections
from draftlab.targets.packed_linear import available as packed_available
from draftlab.targets.packed_linear import packed_linear
from draftlab.targets.row_kernels import weight_major
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

MODES = ("off", "auto", "on")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Slots a compiled target's caches get beyond what is asked: a pass of the largest bucket padded from one row
# more than the previous bucket, plus the free slot after it (``try_forward``).
PAD_SLOTS = ROW_BUCKETS[-1] - ROW_BUCKETS[-2] + 1
# CPU products by rows (experiments/engine_baseline part f): one row as a reduction inductor vectorises over
# the weights (a fused multi-row reduction is mis-tiled by inductor: it parallelises the norm's reduction
# instead of the weights' rows); more rows in bf16 where oneDNN has bf16 kernels (AVX512-BF16 / AMX) through
# its reordered weights (``packed_linear``: a pass of 2-8 rows reads the weights about once), otherwise a few
# rows as the weight-major GEMM and many as a plain GEMM (in fp32 the reordered weights were slower than both).
ROW_PRODUCT_MAX_ROWS = 1
WEIGHT_MAJOR_MAX_ROWS = 32
# ``auto`` compiles targets at least this large (bytes of weights): below it (the 2-layer test target) a step
# costs microseconds and the seconds of compilation never pay back within a run.
AUTO_MIN_WEIGHT_BYTES = 64 * 2**20


def bucket(rows: int) -> int | None:
    """The smallest row bucket holding ``rows`` rows, or None when a pass that large runs eager."""
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def resolve_mode(mode: str, *, device: torch.device, weight_bytes: int, supported: bool) -> bool:
    """Whether passes are compiled: ``on`` always (where the explicit forward is supported), ``off`` never,
    ``auto`` for targets of at least ``AUTO_MIN_WEIGHT_BYTES`` on CPU (measured faster: part f of
    experiments/engine_baseline) and CUDA."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
    if mode == "off" or not supported:
        return False
    if mode == "on":
        return True
    return device.type in ("cpu", "cuda") and weight_bytes >= AUTO_MIN_WEIGHT_BYTES


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight.T`` as a reduction over ``in`` with W's rows outermost: compiled, each weight row
    is read once for every row of ``x`` (a memory-bound product's best case). [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    y = (weight[:, None, :] * rows[None]).sum(-1).T  # [R, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def weight_major_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight.T`` as ``(weight @ x.T).T``: the GEMM with the weight as its tall left operand,
    MKL's fast orientation for a few rows. [..., out]."""
    y = weight_major(x.reshape(-1, x.shape[-1]), weight)  # [R, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def static_layer(target, w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 slots: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, linear) -> torch.Tensor:
    """One decoder layer as it is compiled (one graph serves every layer: the weights ``w`` are inputs): rows
    ``x [1, T, d]`` write K/V at cache ``slots [T]`` in place into this layer's ``kc/vc [1, Hkv, S_max, hd]``
    and attend to slots ``[0, S)`` under ``mask [1, 1, T, S]`` -> [1, T, d]. The norms, projections, RoPE and
    MLP are the eager forward's own functions (``layer_math.layer_projections`` / ``layer_output``)."""
    q, k, v = layer_projections(target, w, x, cos, sin, linear)
    kc.index_copy_(2, slots, k)
    vc.index_copy_(2, slots, v)
    S = mask.shape[-1]
    o = grouped_attention(q, kc[:, :, :S], vc[:, :, :S], mask, w["scaling"])  # [1, H, T, hd]
    return layer_output(target, w, x, o, linear)


def _own_code(fn, name: str):
    """``fn`` with a code object of its own: dynamo keeps compiled graphs, and counts its recompile limit, per
    code object, so the functions of different buckets (one closure in the source) must not share one."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class CompileStats:
    """What compilation cost this target (the run record's ``engine`` block)."""

    graphs: int = 0  # graphs compiled (first compiles and recompiles)
    seconds: float = 0.0  # wall time spent compiling
    recompiles: int = 0  # graphs compiled again for a bucket that already had one
    per_bucket: dict[str, int] = field(default_factory=dict)  # graphs compiled per bucket / function
    compiled_passes: int = 0  # passes that ran compiled
    eager_passes: int = 0  # passes the compiled graphs did not cover (prefill, pinned rows, ...)

    def as_dict(self) -> dict:
        return {"graphs": self.graphs, "compile_seconds": round(self.seconds, 3), "recompiles": self.recompiles,
                "compiled_passes": self.compiled_passes, "eager_passes": self.eager_passes,
                "graphs_per_bucket": dict(self.per_bucket)}


class CompiledPasses:
    """The compiled passes of one target: per row bucket, one compiled decoder layer and one compiled head."""

    def __init__(self, target):
        self.target = target
        self.stats = CompileStats()
        self._layer: dict[int, object] = {}
        self._head: dict[int, object] = {}

    def _backend(self, key: str):
        from torch._inductor.compile_fx import compile_fx

        def backend(gm, example_inputs):
            t0 = time.perf_counter()
            n = self.stats.per_bucket.get(key, 0)
            if n:
                self.stats.recompiles += 1
                log.warning("compiled %s compiled again (%d graphs now): its inputs' shapes or guards changed",
                            key, n + 1)
            compiled = compile_fx(gm, example_inputs)
            dt = time.perf_counter() - t0
            self.stats.graphs += 1
            self.stats.seconds += dt
            self.stats.per_bucket[key] = n + 1
            log.info("compiled %s in %.1f s", key, dt)
            return compiled

        return backend

    def _product(self, rows: int):
        if self.target.device.type != "cpu":
            return F.linear
        if rows <= ROW_PRODUCT_MAX_ROWS:
            return row_product
        if self.target.dtype == torch.bfloat16 and packed_available(torch.bfloat16):
            return packed_linear
        return weight_major_product if rows <= WEIGHT_MAJOR_MAX_ROWS else F.linear

    def layer_fn(self, rows: int):
        if rows not in self._layer:
            target, product = self.target, self._product(rows)

            def layer(w, x, cos, sin, mask, slots, kc, vc):
                return static_layer(target, w, x, cos, sin, mask, slots, kc, vc, product)

            self._layer[rows] = torch.compile(_own_code(layer, f"layer_rows{rows}"),
                                              backend=self._backend(f"layer/rows={rows}"), dynamic=False)
        return self._layer[rows]

    def head_fn(self, rows: int):
        if rows not in self._head:
            target, product = self.target, self._product(rows)

            def head(x):
                h = target.final_norm(x)  # [1, T, d]
                return product(h, target.model.lm_head.weight, target.model.lm_head.bias), h

            self._head[rows] = torch.compile(_own_code(head, f"head_rows{rows}"),
                                             backend=self._backend(f"head/rows={rows}"), dynamic=False)
        return self._head[rows]

    def forward(self, x: torch.Tensor, position_ids, cache, attn_mask, req, write_cache: bool):
        """``HFTarget.forward``'s pass of rows ``x [B, T, d]`` through the graphs: a ``TargetOutput``, or None
        (counted as an eager pass) when the graphs do not cover it."""
        from draftlab.targets.base import LayerConvention, TargetOutput

        got = None
        if write_cache and req.pinned is None and not req.attn_mass_rows:
            taps = self.target.check_layer_ids(req.aux_layer_ids(self.target.aux_layer_ids))
            got = self.try_forward(x, position_ids, cache, attn_mask, taps,
                                   self.target.layer_convention is LayerConvention.INPUT_TO, req.last_hidden)
        if got is None:
            self.stats.eager_passes += 1
            return None
        logits, captured, last = got  # [1, T, V], {layer: [1, T, d]}, [1, T, d] | None
        aux = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [1, T, n_taps * d]
        if req.logits_rows is not None:
            logits = logits[:, req.logits_rows]  # [1, R, V]
        return TargetOutput(logits=logits, aux_hidden=aux, last_hidden=last)

    def try_forward(self, x: torch.Tensor, position_ids, cache, attn_mask, taps: list[int], capture_in: bool,
                    want_last: bool):
        """The pass of rows ``x [1, T, d]`` compiled, or None when it is not one the graphs cover.

        Returns (logits [1, T, V], {layer: hidden [1, T, d]} for ``taps``, last [1, T, d] or None)."""
        T = x.shape[1]
        got = self.run_layers(x, position_ids, cache, attn_mask, None, taps, capture_in)
        if got is None:
            return None
        x, captured = got
        logits, last = self.head_fn(x.shape[1])(x)
        self.stats.compiled_passes += 1
        return logits[:, :T], captured, last[:, :T] if want_last else None

    def layers_pass(self, x: torch.Tensor, position_ids, cache, attn_mask, slots, taps: list[int]):
        """``HFTarget.forward_layers`` over all layers, compiled: a ``LayerOutput``, or None (counted as an eager
        pass) when the graphs do not cover it."""
        from draftlab.targets.base import LayerConvention, LayerOutput

        got = self.run_layers(x, position_ids, cache, attn_mask, slots, taps,
                              self.target.layer_convention is LayerConvention.INPUT_TO)
        if got is None:
            self.stats.eager_passes += 1
            return None
        self.stats.compiled_passes += 1
        h, captured = got
        aux = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [1, T, n_taps * d]
        return LayerOutput(hidden=h[:, :x.shape[1]], aux=aux)

    def run_layers(self, x: torch.Tensor, position_ids, cache, attn_mask, slots, taps: list[int],
                   capture_in: bool):
        """Every decoder layer on rows ``x [1, T, d]`` through the bucket's graph: (x [1, rows, d] with the pad
        rows at the end, {layer: hidden [1, T, d]} for ``taps``), or None when the pass is not one it covers.

        ``slots``: None (the rows go to ``cache.length + arange(T)``, pad rows to the scratch after them), or
        the rows' explicit cache slots with the mask over ``[0, S)`` they need; then only passes of exactly a
        bucket's rows compile (a pad row has no scratch slot the caller is known not to use)."""
        B, T, _ = x.shape
        rows = bucket(T)
        if B != 1 or rows is None or cache is None or cache.ragged or torch.is_grad_enabled():
            return None
        past = cache.length
        dev = x.device
        if attn_mask is not None and attn_mask.dim() == 3:
            if attn_mask.shape[0] != 1:
                return None
            attn_mask = attn_mask[0]
        if slots is None:
            # past == 0: a prefill (fused SDPA and GEMMs, eager).
            if past == 0:
                return None
            slots = torch.arange(past, past + rows, device=dev)
            S_real = past + T
            if attn_mask is None:
                attn_mask = torch.ones(T, S_real, dtype=torch.bool, device=dev).tril(past)
        else:
            if attn_mask is None or rows != T:
                return None
            slots = torch.as_tensor(slots, device=dev).reshape(-1)
            S_real = attn_mask.shape[-1]
        # The graphs' attention width S (the mask's) must leave a slot free after it: a first compile that sees
        # S == S_max would specialise on the cache ending where the pass does.
        S = S_real + rows - T
        if S >= cache.max_length:
            return None
        if position_ids is None:
            position_ids = slots[:T]
        position_ids = position_ids.reshape(-1)
        if position_ids.numel() != T:
            return None  # per-sequence positions of a batch: eager
        # [rows, S]: the real rows' mask in the top-left corner; pad rows see slot 0 only.
        mask = torch.zeros(rows, S, dtype=torch.bool, device=dev)
        mask[:T, :S_real] = attn_mask
        mask[T:, 0] = True
        mask = mask.view(1, 1, rows, S)
        torch._dynamo.mark_dynamic(mask, 3)
        cos_t, sin_t = self.target._rope_tables(int(position_ids.max()) + 1, x)
        pos = F.pad(position_ids, (0, rows - T), value=int(position_ids[0])) if rows > T else position_ids
        cos, sin = cos_t[pos][None, None], sin_t[pos][None, None]  # [1, 1, rows, hd]
        if rows > T:
            x = F.pad(x, (0, 0, 0, rows - T))  # [1, rows, d]
        layer, captured = self.layer_fn(rows), {}
        for li, w in enumerate(self.target._layers):
            if capture_in and li in taps:
                captured[li] = x[:, :T]
            kc, vc = cache.k[li], cache.v[li]  # [1, Hkv, S_max, hd]; S_max differs between sequences
            torch._dynamo.mark_dynamic(kc, 2)
            torch._dynamo.mark_dynamic(vc, 2)
            x = layer(w, x, cos, sin, mask, slots, kc, vc)
            if not capture_in and li in taps:
                captured[li] = x[:, :T]
        return x, captured
