"""Native EAGLE-3 format (SpecForge / SGLang / vLLM ``method: eagle3``): ``config.json`` + ``model.safetensors``.

Weights use the draft's own names (identity map). ``eagle_config.eagle_aux_hidden_state_layer_ids`` is
written in the ``output_of`` convention that SpecForge and SGLang use. A ``draftlab`` block carries the
full draft config and its layer convention, so draftlab reloads the file exactly; engines ignore it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from draftlab.export.common import (
    NATIVE_ARCHITECTURE,
    assemble_draft,
    default_ids_from_target,
    dtype_name,
    export_tensors,
    is_target_factory,
    llama_layer_fields,
    read_config,
    read_tensors,
    resolve_dtype,
    resolve_max_positions,
    verifier_info,
    write_hf_dir,
)
from draftlab.methods.eagle3.config import Eagle3Config, rope_from_hf_config
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.targets.base import LayerConvention, to_convention
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

DRAFTLAB_BLOCK = "draftlab"
DRAFTLAB_BLOCK_VERSION = 1


def native_config(config: Eagle3Config, *, torch_dtype: str, max_position_embeddings: int,
                  verifier_name: str | None = None) -> dict[str, Any]:
    """The native ``config.json`` dict for a draft with ``config``."""
    c = config
    aux = [to_convention(i, c.layer_convention, LayerConvention.OUTPUT_OF) for i in c.aux_layer_ids]
    if aux and aux[0] != 1:
        # SGLang (since its PR #25454) treats an id list as output_of only when the first id is 1 and
        # otherwise reads it as input_to; older SGLang always reads output_of. Only first id 1 is safe.
        log.warning("aux layer ids %s (output_of) do not start at 1: recent SGLang would read them as input_to, "
                    "i.e. one layer off. Check the draft against the serving engine.", aux)
    out: dict[str, Any] = {"architectures": [NATIVE_ARCHITECTURE], **llama_layer_fields(c)}
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    out.update({
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "target_hidden_size": c.target_hidden_size,
        # Written even at their defaults: engines disagree on what a missing key means.
        "fc_norm": c.fc_norm,
        "norm_before_fc": c.norm_before_fc,
        "norm_before_residual": c.norm_before_residual,
        "norm_output": c.norm_output,
    })
    if aux:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    out[DRAFTLAB_BLOCK] = {
        "version": DRAFTLAB_BLOCK_VERSION,
        # Convention of the ids in eagle3_config.aux_layer_ids (the draft's own) ...
        "layer_convention": c.layer_convention,
        # ... and of the ids in eagle_config above (always output_of).
        "eagle_config_layer_convention": LayerConvention.OUTPUT_OF.value,
        "eagle3_config": c.to_dict(),
        "verifier": verifier_name,
    }
    return out


def save_native(draft: Eagle3Draft, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                include_embedding: bool = False, verifier=None, max_position_embeddings: int | None = None) -> Path:
    """Write ``draft`` as a native EAGLE-3 directory (``config.json`` + ``model.safetensors``); returns it.

    dtype                    cast floating weights (``None`` keeps the draft's dtype); d2t/t2d keep theirs.
    include_embedding        also write the frozen ``embed_tokens.weight`` (engines reuse the target's).
    verifier                 the target the draft serves with (a draftlab Target, an HF config, a dict or a
                             name): its ``max_position_embeddings`` and name are recorded.
    max_position_embeddings  overrides the verifier's value (default 2048 when neither is known).
    """
    cast = resolve_dtype(dtype)
    tensors = export_tensors(draft, dtype=cast, include_embedding=include_embedding)
    info = verifier_info(verifier)
    config = native_config(draft.config, torch_dtype=dtype_name(tensors["fc.weight"].dtype),
                           max_position_embeddings=resolve_max_positions(max_position_embeddings, info),
                           verifier_name=info.get("name"))
    return write_hf_dir(out_dir, config, tensors)


def _require(cfg: dict[str, Any], key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: config.json lacks required key '{key}'")
    return cfg[key]


def config_from_native_json(cfg: dict[str, Any], tensor_keys, *, source: str, target=None) -> Eagle3Config:
    """An ``Eagle3Config`` from a native config dict: the draftlab block if present, else the plain keys.

    Plain (SpecForge / EAGLE) configs take aux ids from ``eagle_config`` as output_of, or the engines'
    defaults for ``target``'s depth when absent (empty without a target). Variant switches missing from
    the config are inferred from the tensor keys (``fc_norm.*``, ``input_norm.weight``).
    """
    block = cfg.get(DRAFTLAB_BLOCK)
    if isinstance(block, dict) and "eagle3_config" in block:
        try:
            return Eagle3Config.from_dict(dict(block["eagle3_config"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: invalid draftlab block: {e}") from e

    keys = set(tensor_keys)
    d = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    vocab = int(_require(cfg, "vocab_size", source))
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = default_ids_from_target(target, LayerConvention.OUTPUT_OF)
    rope_theta, rope_scaling = rope_from_hf_config(SimpleNamespace(**cfg))
    try:
        return Eagle3Config(
            hidden_size=d,
            intermediate_size=int(_require(cfg, "intermediate_size", source)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or d // heads),
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # LlamaConfig's default
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            target_hidden_size=int(cfg.get("target_hidden_size") or d),
            num_layers=int(cfg.get("num_hidden_layers", 1)),
            aux_layer_ids=list(aux),
            layer_convention=LayerConvention.OUTPUT_OF.value,
            fc_norm=bool(cfg.get("fc_norm", "fc_norm.0.weight" in keys)),
            norm_before_fc=bool(cfg.get("norm_before_fc", "input_norm.weight" in keys)),
            # Native EAGLE-3 / SpecForge drafts add the raw hidden state to the residual.
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_output=bool(cfg.get("norm_output", True)),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e


def load_native(path: str | Path, *, target=None, require_embedding: bool = True,
                dtype: str | torch.dtype | None = None) -> Eagle3Draft:
    """Load a native EAGLE-3 directory (draftlab's own export, or a SpecForge / EAGLE checkpoint).

    Weights load strictly (missing / unexpected keys raise ``ValueError`` naming them). The embedding is
    taken from the file if present, else from ``target`` (a Target, or a zero-argument function returning
    one); with neither, ``require_embedding=True`` raises, ``False`` leaves it NaN-filled. ``dtype``
    defaults to the file's.
    """
    source = str(path)
    cfg = read_config(path)
    tensors = read_tensors(path)
    real_target = None if is_target_factory(target) else target
    config = config_from_native_json(cfg, tensors.keys(), source=source, target=real_target)
    return assemble_draft(config, tensors, source=source, target=target, require_embedding=require_embedding,
                          dtype=dtype)


__all__ = ["config_from_native_json", "load_native", "native_config", "save_native"]
