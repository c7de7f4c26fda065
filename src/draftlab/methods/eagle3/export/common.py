"""Pieces shared by the EAGLE-3 export formats: key layouts, expected shapes, file IO and draft assembly.

The draft's own parameter names are the native EAGLE-3 / SpecForge / SGLang names, so the native format is
an identity map; the speculators format only renames the decoder layers (``midlayer.`` -> ``layers.0.``,
``additional_layers.{i}.`` -> ``layers.{i+1}.``).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.nn.placement import target_device
from draftlab.targets.base import LayerConvention, default_aux_layer_ids
from draftlab.utils.errors import ArtifactError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

NATIVE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# The speculators release whose config layout the writer follows.
SPECULATORS_VERSION = "0.3.0"
# Used only when neither the caller, the verifier nor the source checkpoint says otherwise (SpecForge's
# shipped draft configs use this value).
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
EMBED_KEY = "embed_tokens.weight"
# Prefixes that training wrappers add (Lightning module attribute, DDP/FSDP, torch.compile, HF base model);
# an engine loading the file would not find its weights under any of them.
FOREIGN_PREFIXES = ("draft.", "draft_model.", "model.", "module.", "_orig_mod.")

_FIRST_LAYER_SUFFIXES = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# Layers after the first read the d-dim stream only, so they have no hidden_norm.
_LATER_LAYER_SUFFIXES = tuple(s for s in _FIRST_LAYER_SUFFIXES if s != "hidden_norm.weight")


@dataclass(frozen=True)
class Dims:
    """The sizes and switches that fix an EAGLE-3 draft's tensor layout."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_layers: int = 1
    fc_norm: bool = False
    norm_before_fc: bool = False

    @classmethod
    def from_config(cls, c: Eagle3Config) -> Dims:
        return cls(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                   c.draft_vocab_size, c.target_hidden_size, c.num_layers, c.fc_norm, c.norm_before_fc)


def llama_layer_fields(c: Eagle3Config) -> dict[str, Any]:
    """The Llama decoder-layer fields both formats write (native at the top level, speculators nested).

    ``head_dim`` is always explicit: speculators builds its rotary table from a copy of the config with
    ``hidden_size`` doubled, so a derived ``hidden_size / heads`` would come out twice too large.
    """
    return {"model_type": "llama", **c.layer.hf_fields(c.num_layers)}


def native_layer_prefix(i: int) -> str:
    return "midlayer." if i == 0 else f"additional_layers.{i - 1}."


def speculators_layer_prefix(i: int) -> str:
    return f"layers.{i}."


def vllm_layer_prefix(i: int) -> str:
    """vLLM's EAGLE-3 model maps only ``midlayer.`` (to ``layers.0.``); later layers must be ``layers.{i}.``."""
    return "midlayer." if i == 0 else f"layers.{i}."


def expected_shapes(dims: Dims, layer_prefix: Callable[[int], str]) -> dict[str, tuple[int, ...]]:
    """Every tensor key (embedding excluded) and its shape, with decoder layers named by ``layer_prefix``."""
    d, dt, ff = dims.hidden_size, dims.target_hidden_size, dims.intermediate_size
    q_out, kv_out = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if dims.fc_norm:
        for j in range(3):
            shapes[f"fc_norm.{j}.weight"] = (dt,)
    if dims.norm_before_fc:
        shapes["input_norm.weight"] = (3 * dt,)
    shapes["fc.weight"] = (d, 3 * dt)
    for i in range(dims.num_layers):
        p, width = layer_prefix(i), (2 * d if i == 0 else d)
        layer = {
            "input_layernorm.weight": (d,),
            "hidden_norm.weight": (d,),
            "self_attn.q_proj.weight": (q_out, width),
            "self_attn.k_proj.weight": (kv_out, width),
            "self_attn.v_proj.weight": (kv_out, width),
            "self_attn.o_proj.weight": (d, q_out),
            "post_attention_layernorm.weight": (d,),
            "mlp.gate_proj.weight": (ff, d),
            "mlp.up_proj.weight": (ff, d),
            "mlp.down_proj.weight": (d, ff),
        }
        for suffix in (_FIRST_LAYER_SUFFIXES if i == 0 else _LATER_LAYER_SUFFIXES):
            shapes[p + suffix] = layer[suffix]
    shapes["norm.weight"] = (d,)
    shapes["lm_head.weight"] = (dims.draft_vocab_size, d)
    shapes["d2t"] = (dims.draft_vocab_size,)
    shapes["t2d"] = (dims.vocab_size,)
    return shapes


_ADDITIONAL = re.compile(r"additional_layers\.(\d+)\.(.*)")
_LAYERS = re.compile(r"layers\.(\d+)\.(.*)")


def native_to_speculators_key(key: str) -> str:
    if key.startswith("midlayer."):
        return "layers.0." + key.removeprefix("midlayer.")
    m = _ADDITIONAL.fullmatch(key)
    return f"layers.{int(m.group(1)) + 1}.{m.group(2)}" if m else key


def native_to_vllm_key(key: str) -> str:
    m = _ADDITIONAL.fullmatch(key)
    return f"layers.{int(m.group(1)) + 1}.{m.group(2)}" if m else key


def speculators_to_native_key(key: str) -> str:
    m = _LAYERS.fullmatch(key)
    if not m:
        return key
    i = int(m.group(1))
    return native_layer_prefix(i) + m.group(2)


# ------------------------------------------------------------------------------------------------------
# file IO


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from draftlab.targets.hf import resolve_dtype as _resolve

    return _resolve(str(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_tensors(draft: Eagle3Draft, *, dtype: torch.dtype | None, include_embedding: bool,
                   rename: Callable[[str], str] = lambda k: k) -> dict[str, torch.Tensor]:
    """The draft's state dict on CPU, floats cast to ``dtype``; the frozen embedding only on request."""
    out = {}
    for key, t in draft.state_dict().items():
        if key == EMBED_KEY and not include_embedding:
            continue
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        # safetensors refuses views into larger storages; clone makes each tensor own its memory.
        out[rename(key)] = t.contiguous().clone()
    return out


def floating_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    t = tensors.get("fc.weight")
    if t is None:
        t = next((v for v in tensors.values() if v.is_floating_point()), None)
    return t.dtype if t is not None else torch.float32


def write_hf_dir(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A stale pytorch_model.bin next to the new safetensors would be picked up by some loaders.
    (out / BIN_FILE).unlink(missing_ok=True)
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"not valid JSON: {e.msg} (column {e.colno})", file=file, line=e.lineno) from e
    if not isinstance(data, dict):
        raise ArtifactError("must hold a JSON object", file=file)
    return data


def weights_file(path: str | Path) -> Path:
    path = Path(path)
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"no {SAFETENSORS_FILE} (or {BIN_FILE}) in {path}")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    file = weights_file(path)
    try:
        if file.name == SAFETENSORS_FILE:
            from safetensors.torch import load_file

            return load_file(str(file))
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch raise several unrelated types for damaged files
        raise ArtifactError(f"cannot read weights (truncated or corrupt?): {type(e).__name__}: {e}", file=file) from e
    if not isinstance(sd, dict):
        raise ArtifactError("does not hold a state dict", file=file)
    return sd


# ------------------------------------------------------------------------------------------------------
# config helpers


def default_ids_from_target(target, convention: LayerConvention) -> list[int]:
    """Engines' default aux ids for ``target``'s depth in ``convention``; [] without a target."""
    if target is None:
        return []
    return default_aux_layer_ids(target.geometry.num_layers, convention)


def verifier_info(verifier) -> dict[str, Any]:
    """``name``, ``max_position_embeddings`` and ``architectures`` of a Target, an HF config, a dict, a
    directory holding the target's ``config.json`` (read, no weights), or a bare name."""
    if verifier is None:
        return {}
    if isinstance(verifier, (str, Path)):
        if (Path(verifier) / CONFIG_FILE).is_file():
            return {**verifier_info(read_config(verifier)), "name": str(verifier)}
        return {"name": str(verifier)}
    cfg = verifier
    if hasattr(verifier, "model") and hasattr(verifier.model, "config"):
        cfg = verifier.model.config
    elif hasattr(verifier, "config") and not isinstance(verifier, dict):
        cfg = verifier.config
    get = cfg.get if isinstance(cfg, dict) else (lambda k, default=None: getattr(cfg, k, default))
    # Multimodal targets keep the language model's context length in a text sub-config.
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    max_positions = get("max_position_embeddings") or getattr(text, "max_position_embeddings", None)
    name = getattr(verifier, "name", None) or get("_name_or_path") or get("name_or_path")
    return {k: v for k, v in {"name": name, "max_position_embeddings": max_positions,
                              "architectures": get("architectures")}.items() if v}


def resolve_max_positions(explicit: int | None, verifier: dict[str, Any]) -> int:
    """``explicit``, else the verifier's ``max_position_embeddings``; 2048 with a warning only when neither is
    known (engines size the draft's RoPE from it and vLLM caps the draft's context length at it)."""
    if explicit is not None:
        return int(explicit)
    if verifier.get("max_position_embeddings"):
        return int(verifier["max_position_embeddings"])
    log.warning("max_position_embeddings unknown (no verifier given); writing %d. Serving engines size the "
                "draft's RoPE tables from it: pass max_position_embeddings or the verifier for longer contexts.",
                DEFAULT_MAX_POSITION_EMBEDDINGS)
    return DEFAULT_MAX_POSITION_EMBEDDINGS


# ------------------------------------------------------------------------------------------------------
# assembling a draft from loaded tensors


def is_target_factory(target) -> bool:
    # Targets themselves are callable (forward), so only plain functions count as deferred construction.
    return inspect.isfunction(target) or inspect.ismethod(target) or isinstance(target, functools.partial)


def assemble_draft(config: Eagle3Config, tensors: dict[str, torch.Tensor], *, source: str, target=None,
                   require_embedding: bool = True, dtype: torch.dtype | str | None = None,
                   device: torch.device | str | None = None) -> Eagle3Draft:
    """Build ``Eagle3Draft(config)`` and load ``tensors`` (native key names) strictly.

    Missing or unexpected keys and wrong shapes raise ``ValueError`` naming them and ``source``. The
    embedding comes from ``tensors`` if present, else from ``target`` (a Target, or a zero-argument function
    building one, called only here). With neither, ``require_embedding`` decides: raise, or fill the
    embedding with NaN so that any accidental forward is visibly wrong (an export-only draft).

    The draft comes back on ``device`` if given, else on the target's device (a Target, or a factory built
    here for the embedding), else on the CPU: a CPU draft beside a GPU target would copy the target's
    features to the host every round.
    """
    draft = Eagle3Draft(config)
    expected = set(draft.state_dict()) - {EMBED_KEY}
    present = set(tensors) - {EMBED_KEY}
    missing = expected - present
    if config.draft_vocab_size == config.vocab_size:
        # EAGLE drops d2t/t2d when the draft keeps the full vocabulary; the identity mapping stands in.
        missing -= {"d2t", "t2d"}
    unexpected = present - expected
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {sorted(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {sorted(unexpected)}")
        raise ValueError(f"{source}: weights do not match the draft config: " + "; ".join(parts))

    if is_target_factory(target):
        # Built only when the embedding must come from it (then its device is the draft's too).
        target = target() if EMBED_KEY not in tensors else None
    dtype = resolve_dtype(dtype) or floating_dtype(tensors)
    draft.to(device=target_device(target, device), dtype=dtype)
    try:
        draft.load_state_dict({k: tensors[k] for k in present}, strict=False)
    except RuntimeError as e:
        raise ValueError(f"{source}: {e}") from e

    with torch.no_grad():
        if EMBED_KEY in tensors:
            emb = tensors[EMBED_KEY]
            if tuple(emb.shape) != tuple(draft.embed_tokens.weight.shape):
                raise ValueError(f"{source}: {EMBED_KEY} has shape {tuple(emb.shape)}, the config needs "
                                 f"{tuple(draft.embed_tokens.weight.shape)}")
            draft.embed_tokens.weight.copy_(emb)
        elif target is not None:
            draft.load_target_embedding(target)
        elif require_embedding:
            raise ValueError(f"{source} holds no {EMBED_KEY} (exports omit the frozen target embedding); "
                             "pass target=<the target model> to take it from the target")
        else:
            draft.embed_tokens.weight.fill_(float("nan"))
    draft.embed_tokens.weight.requires_grad_(False)
    return draft
