"""Offline target features through vLLM: the same store ``data/features.py`` writes, computed by the engine.

vLLM 0.32's ``extract_hidden_states`` speculative method hands back, per request, the residual stream at chosen
layer ids (id L = the input of layer L = HF ``hidden_states[L]``; id ``num_layers`` = the final residual, before
the model's norm). This maps draftlab's tapped layers (in the target's layer convention) onto those ids, runs
``vllm_side/extract_hidden_states.py`` with the engine's interpreter, and writes each sample as
``precompute_features`` does: ``aux [T, n_taps * d]`` and ``last [T, d]`` (the target's final norm applied
here to the final residual, as HF's last hidden state has it). Resumable at both ends: the engine skips
sequences whose raw file exists, the store skips samples already written; ``complete.json`` marks the end.

On the CPU build, vLLM's own connector needs pinned CUDA memory; ``vllm_side/cpu_hidden_states_connector.py``
writes from host memory instead (``connector="cpu"``, the default). On a GPU, ``connector="stock"``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftlab.targets.base import to_hf_hidden_index
from draftlab.utils.atomic import atomic_write_text
from draftlab.utils.errors import UserError

SCRIPT = Path(__file__).resolve().parent / "vllm_side" / "extract_hidden_states.py"


def vllm_layer_ids(aux_layer_ids: Sequence[int], convention: str, num_layers: int) -> list[int]:
    """The vLLM ids of draftlab's taps, then ``num_layers`` (the final residual that ``last`` is made from)."""
    return [to_hf_hidden_index(int(i), convention) for i in aux_layer_ids] + [int(num_layers)]


def _final_norm(target) -> torch.nn.Module:
    model = target.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.norm


@torch.no_grad()
def store_sample(raw: torch.Tensor, norm: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``raw [T, n_taps + 1, d]`` (the engine's rows) -> the feature store's ``aux [T, n_taps * d]``, ``last [T, d]``."""
    t, n, d = raw.shape
    w = next(norm.parameters())
    last = norm(raw[:, n - 1].to(device=w.device, dtype=w.dtype))
    return {"aux": raw[:, : n - 1].reshape(t, (n - 1) * d).to(dtype).contiguous(),
            "last": last.to("cpu", dtype).contiguous()}


def run_engine(python: str, model: str, layers: list[int], sequences: dict[int, list[int]], out: Path, *,
               dtype: str = "float32", max_model_len: int = 4096, connector: str = "cpu",
               env: dict[str, str] | None = None, timeout: float | None = None, extra: Sequence[str] = ()) -> None:
    """Run the engine-side script for ``sequences`` (index -> token ids); raw files land in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    req = out / "requests.jsonl"
    atomic_write_text(req, "".join(json.dumps({"index": i, "token_ids": ids}) + "\n" for i, ids in sequences.items()))
    cmd = [python, str(SCRIPT), "--model", model, "--layers", ",".join(map(str, layers)), "--requests", str(req),
           "--out", str(out), "--dtype", dtype, "--max-model-len", str(max_model_len), "--connector", connector,
           *extra]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"vLLM hidden-state extraction failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def vllm_feature_store(target, samples, root: str | Path, *, aux_layer_ids: Sequence[int], python: str,
                       model: str | None = None, dtype: str = "float32", connector: str = "cpu",
                       max_model_len: int | None = None, env: dict[str, str] | None = None,
                       extra: Sequence[str] = ()) -> Path:
    """Write ``precompute_features``' store for ``samples`` under ``root``, the hidden states computed by vLLM."""
    root = Path(root)
    if (root / "complete.json").exists():
        return root
    model = model or str(getattr(target.model.config, "_name_or_path", "") or "")
    if not model:
        raise UserError("the target has no model directory to serve; pass model=", field="model")
    convention = getattr(target.layer_convention, "value", str(target.layer_convention))
    num_layers = int(target.model.config.num_hidden_layers)
    layers = vllm_layer_ids(aux_layer_ids, convention, num_layers)
    todo = {i: list(s.input_ids) for i, s in enumerate(samples) if not (root / f"{i:07d}.safetensors").exists()}
    raw = root / ".vllm_raw"
    if todo:
        longest = max(len(ids) for ids in todo.values())
        run_engine(python, model, layers, todo, raw, dtype=dtype, connector=connector, env=env, extra=extra,
                   max_model_len=max_model_len or max(longest + 8, 256))
    norm, store_dtype = _final_norm(target), getattr(torch, dtype)
    for i in todo:
        rows = load_file(str(raw / f"{i:07d}.safetensors"))
        if rows["token_ids"].tolist() != todo[i]:
            raise RuntimeError(f"{raw / f'{i:07d}.safetensors'}: rows of other tokens than sample {i}")
        path = root / f"{i:07d}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(store_sample(rows["hidden_states"], norm, store_dtype), str(tmp),
                  metadata={"id": samples[i].id, "length": str(len(todo[i])), "engine": "vllm"})
        os.replace(tmp, path)
    atomic_write_text(root / "complete.json", json.dumps({"num_samples": len(samples), "dtype": dtype, "engine": "vllm"}))
    return root


def vllm_offline_features(*, target, draft, samples, root: str | Path, key: tuple, python: str,
                          model: str | None = None, dtype: str = "auto", connector: str = "cpu", env: dict[str, str] | None = None,
                          extra: Sequence[str] = ("--enforce-eager",)) -> Path:
    """A method's ``features`` entry computed by vLLM (same arguments as ``data.features.offline_features``)::

        method.features._target_=draftlab.serving.hidden_states.vllm_offline_features
        +method.features.python=/path/to/vllm-venv/bin/python

    The store's key is ``offline_features``' plus the engine: the two agree to fp32 rounding, not bit for bit,
    so they never share a directory."""
    from draftlab.data.features import feature_key, store_dtype_name

    dtype = store_dtype_name(dtype, target)
    layers = draft.taps(target)
    convention = getattr(target.layer_convention, "value", str(target.layer_convention))
    target_id, data_key = key
    fkey = feature_key({"target": target_id, "engine": "vllm"}, data_key, layers, convention, dtype, len(samples))
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return vllm_feature_store(target, samples, Path(root) / "features" / fkey, aux_layer_ids=layers, python=python,
                              model=model, dtype=dtype, connector=connector, env=env, extra=extra)
