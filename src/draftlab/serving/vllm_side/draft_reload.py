"""Reload a served draft's weights in place, keeping the target loaded (runs inside vLLM's own environment; it
imports vLLM's workers' torch and safetensors, never draftlab).

A served check during training wants the newest draft in a server that is already up: a fresh vLLM start costs
one to three minutes on a CPU, most of it the target. vLLM 0.32 updates draft weights only through its
weight-transfer engines (NCCL / CUDA IPC: GPU-only). Its workers do accept extension classes
(``--worker-extension-cls``) whose methods ``/collective_rpc`` calls by name (``VLLM_SERVER_DEV_MODE=1``), so
this class adds one method that reads the export's ``*.safetensors`` and hands them to the draft model's own
``load_weights``, the same function vLLM's loader called at start-up with the same files.

On a CPU, vLLM packs each linear layer's weight for its GEMM kernels after loading (oneDNN / sgl-kernel
handles built from the weight) and replaces the parameter with an empty one, so ``load_weights`` alone finds
nothing to load into. The reload therefore recreates those parameters (the layer's own ``create_weights``, with
its shard loader), loads, and packs every processed layer again (``process_weights_after_loading``), also
those that kept their weight (the LM head), whose packed copy would otherwise stay stale.

The vocabulary map (``d2t`` / ``t2d``) is left as loaded at start-up: it does not change during training, and
the proposer may have converted it after loading. The caller checks the result: a reloaded server must answer
as a fresh one would (same outputs; the end of a run can compare τ with a fresh launch).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

_KEPT_AT_STARTUP = ("d2t", "t2d")


class DraftReload:
    """Mixed into vLLM's worker class: ``self`` is the worker (``get_draft_model`` is the GPU worker's, which
    the CPU worker inherits)."""

    def draftlab_reload_draft(self, export_dir: str) -> str:
        model = self.get_draft_model()
        if model is None:
            raise RuntimeError("this server has no draft model to reload (started without --speculative-config?)")
        files = sorted(Path(export_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {export_dir}")
        weights = [(name, tensor) for f in files for name, tensor in load_file(str(f)).items()
                   if name.rsplit(".", 1)[-1] not in _KEPT_AT_STARTUP and name not in _KEPT_AT_STARTUP]
        packed = [m for m in model.modules() if hasattr(m, "cpu_linear") and hasattr(m, "quant_method")]
        with torch.no_grad():
            for layer in packed:
                if layer.weight.numel() == 0:
                    _recreate_weight(layer)
            model.load_weights(iter(weights))
            for layer in packed:
                layer.quant_method.process_weights_after_loading(layer)
        return self.draftlab_draft_checksum()

    def draftlab_draft_checksum(self) -> str:
        """A digest of the draft's parameters (the caller sees that a reload changed them)."""
        digest = hashlib.sha256()
        for name, p in sorted(self.get_draft_model().named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()[:16]


def _recreate_weight(layer) -> None:
    """An empty (packed-away) linear weight made again as the layer made it at construction: its shape from the
    partition sizes, its loader the one the layer's class registers (v2 where the method supports it)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, ReplicatedLinear

    method = layer.quant_method
    v2 = (method.__class__.__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(layer, "weight_loader_v2")
          and not isinstance(layer, ReplicatedLinear))
    method.create_weights(layer=layer, input_size_per_partition=getattr(layer, "input_size_per_partition", layer.input_size),
                          output_partition_sizes=layer.output_partition_sizes, input_size=layer.input_size,
                          output_size=layer.output_size, params_dtype=layer.params_dtype,
                          weight_loader=layer.weight_loader_v2 if v2 else layer.weight_loader)
