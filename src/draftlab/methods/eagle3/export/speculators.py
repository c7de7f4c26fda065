"""speculators format (``Eagle3Speculator``), what ``vllm serve <dir>`` detects on its own.

Differences from the native format: decoder layers are ``layers.{i}.*`` (``midlayer.`` -> ``layers.0.``),
the Llama sizes sit in a nested ``transformer_layer_config``, aux ids are top-level
``eagle_aux_hidden_state_layer_ids`` in the ``input_to`` convention, and a ``speculators_config`` block names
the proposal method and the verifier.

vLLM reads it in ``update_eagle3`` (vllm/transformers_utils/configs/speculators/algos.py), which copies
``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` (default **True**), the top-level
``eagle_aux_hidden_state_layer_ids`` and, in recent releases, ``norm_before_fc``, ``fc_norm`` and
``norm_output`` (default False) onto the config of ``Eagle3LlamaForCausalLM``; from there the keys are read
as in the ``vllm`` native variant (see ``draftlab.methods.eagle3.export.native``): the ids are ``input_to``.

``norm_before_residual`` is always written: vLLM assumes True when a speculators config omits it, while
native EAGLE-3 drafts use False.

``norm_output`` is always written as False. In speculators it means "feed the *post*-norm hidden state back
to the next draft step"; a draftlab draft always feeds the pre-norm residual stream back, which is
speculators' False. (draftlab's own ``norm_output`` is SpecForge's switch for the final norm before
``lm_head``; speculators always applies that norm, so only drafts with ``norm_output=True`` can be exported.)

A draft with a ``sliding_window`` W writes ``layer_types`` (all ``sliding_attention``), ``use_sliding_window:
true`` and ``sliding_window: W`` into ``transformer_layer_config``, the dict vLLM builds the draft's Llama config
from (``update_eagle3`` keeps it), whose ``LlamaAttention`` windows the layers ``layer_types`` marks sliding.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.export.common import (
    SPECULATORS_ARCHITECTURE,
    SPECULATORS_VERSION,
    assemble_draft,
    default_ids_from_target,
    dtype_name,
    export_tensors,
    is_target_factory,
    llama_layer_fields,
    native_to_speculators_key,
    read_config,
    read_tensors,
    resolve_dtype,
    resolve_max_positions,
    speculators_to_native_key,
    verifier_info,
    write_hf_dir,
)
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.nn import rope_from_hf_config
from draftlab.nn.window import hf_window_keys, window_from_hf
from draftlab.targets.base import LayerConvention, to_convention


def speculators_config(config: Eagle3Config, *, torch_dtype: str, max_position_embeddings: int,
                       verifier_name_or_path: str = "", verifier_architectures: list[str] | None = None,
                       speculative_tokens: int = 3) -> dict[str, Any]:
    """The speculators ``config.json`` dict for a draft with ``config``."""
    c = config
    if not c.norm_output:
        raise ValueError("the speculators format always applies the final norm before lm_head; a draft with "
                         "norm_output=False (no final norm) cannot be exported to it")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    layer_config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        **llama_layer_fields(c),
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
    }
    if c.sliding_window is not None:
        layer_config.update(hf_window_keys(c.sliding_window, c.num_layers))
    aux = [to_convention(i, c.layer_convention, LayerConvention.INPUT_TO) for i in c.aux_layer_ids]
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": aux or None,
        "torch_dtype": torch_dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path or "",
                         "architectures": list(verifier_architectures or [])},
        },
    }


def save_speculators(draft: Eagle3Draft, out_dir: str | Path, *, verifier_name_or_path: str = "",
                     verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                     dtype: str | torch.dtype | None = None, include_embedding: bool = False,
                     max_position_embeddings: int | None = None, verifier=None, target=None) -> Path:
    """Write ``draft`` in the speculators format (``config.json`` + ``model.safetensors``); returns the dir.

    verifier_name_or_path / verifier_architectures  the target vLLM loads next to the draft (default: the
                             ``verifier``'s name and architectures).
    speculative_tokens       chain length of the greedy proposal method.
    dtype                    cast floating weights (``None`` keeps the draft's dtype).
    include_embedding        also write ``embed_tokens.weight`` (vLLM reuses the target's otherwise).
    max_position_embeddings  for ``transformer_layer_config``; default the ``verifier``'s (2048, with a
                             warning, when neither is known).
    verifier                 the target (a Target, an HF config, a dict or a directory with its config.json).
    target                   the method registry's name for ``verifier``.
    """
    verifier = verifier if verifier is not None else target
    cast = resolve_dtype(dtype)
    tensors = export_tensors(draft, dtype=cast, include_embedding=include_embedding,
                             rename=native_to_speculators_key)
    info = verifier_info(verifier)
    config = speculators_config(
        draft.config, torch_dtype=dtype_name(tensors["fc.weight"].dtype),
        max_position_embeddings=resolve_max_positions(max_position_embeddings, info),
        verifier_name_or_path=verifier_name_or_path or info.get("name") or "",
        verifier_architectures=verifier_architectures or info.get("architectures"),
        speculative_tokens=speculative_tokens)
    return write_hf_dir(out_dir, config, tensors)


def config_from_speculators_json(cfg: dict[str, Any], *, source: str, target=None) -> Eagle3Config:
    """An ``Eagle3Config`` (convention ``input_to``) from a speculators config dict."""
    if cfg.get("norm_output"):
        raise ValueError(f"{source}: speculators norm_output=true feeds the post-norm hidden state to the next "
                         "draft step; draftlab drafts feed the pre-norm state back and cannot reproduce it")
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{source}: config.json lacks the transformer_layer_config block")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in tl:
            raise ValueError(f"{source}: transformer_layer_config lacks required key '{key}'")
    if tl.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: draft layers of model_type {tl.get('model_type')!r} are not supported "
                         "(draftlab's EAGLE-3 draft is a Llama layer)")
    d, heads, vocab = int(tl["hidden_size"]), int(tl["num_attention_heads"]), int(tl["vocab_size"])
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = default_ids_from_target(target, LayerConvention.INPUT_TO)
    rope_theta, rope_scaling = rope_from_hf_config(SimpleNamespace(**tl))
    try:
        return Eagle3Config(
            hidden_size=d,
            intermediate_size=int(tl["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(tl.get("num_key_value_heads") or heads),
            head_dim=int(tl.get("head_dim") or d // heads),
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            target_hidden_size=int(cfg.get("target_hidden_size") or d),
            num_layers=int(tl.get("num_hidden_layers", 1)),
            aux_layer_ids=list(aux),
            layer_convention=LayerConvention.INPUT_TO.value,
            fc_norm=bool(cfg.get("fc_norm", False)),
            norm_before_fc=bool(cfg.get("norm_before_fc", False)),
            # vLLM's reading of a speculators config without the key.
            norm_before_residual=bool(cfg.get("norm_before_residual", True)),
            norm_output=True,
            sliding_window=window_from_hf(tl, int(tl.get("num_hidden_layers", 1))),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e


def load_speculators(path: str | Path, *, target=None, require_embedding: bool = True,
                     dtype: str | torch.dtype | None = None, device: torch.device | str | None = None
                     ) -> Eagle3Draft:
    """Load a speculators-format EAGLE-3 directory into an ``Eagle3Draft`` (aux ids in ``input_to``).

    Same strictness, embedding and placement rules as ``load_native``. ``verifier_*`` tensors (frozen copies of the
    target's head) are ignored; a missing ``norm_before_residual`` is read as True, as vLLM does.
    """
    source = str(path)
    cfg = read_config(path)
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise ValueError(f"{source}: speculators_model_type is {cfg.get('speculators_model_type')!r}, not 'eagle3'")
    tensors = {speculators_to_native_key(k): v for k, v in read_tensors(path).items()
               if not k.startswith("verifier_")}
    real_target = None if is_target_factory(target) else target
    config = config_from_speculators_json(cfg, source=source, target=real_target)
    return assemble_draft(config, tensors, source=source, target=target, require_embedding=require_embedding,
                          dtype=dtype, device=device)


__all__ = ["config_from_speculators_json", "load_speculators", "save_speculators", "speculators_config"]
