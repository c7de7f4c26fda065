"""Native EAGLE-3 format (``LlamaForCausalLMEagle3``: ``config.json`` + ``model.safetensors``), one variant per engine.

Weights use the draft's own names (an identity map; the ``vllm`` variant names decoder layers after the
first ``layers.{i}.``, as vLLM loads them); the variants differ in ``config.json``, because SGLang and vLLM
read the same keys differently. A ``draftlab`` block records the full draft config, the
variant (``engine``) and the convention of every id list, so draftlab reloads either variant exactly;
engines ignore the block.

How each engine reads the keys (facts from their source; draftlab's ``aux_layer_ids`` name target hidden
states in ``output_of`` = "output of decoder layer i, 0-based" or ``input_to`` = "input to layer i"):

SGLang (``--speculative-algorithm EAGLE3``), variant ``sglang``:

- aux ids: ``ModelRunner.__init__`` (python/sglang/srt/model_executor/model_runner.py) reads only
  ``hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]`` of the draft (missing -> None); the target's
  ``set_eagle3_layers_to_capture`` (python/sglang/srt/models/llama.py, ``LlamaForCausalLM``) stores
  ``layers_to_capture = [id + 1 for id in ids]`` (None: ``[2, L // 2, L - 3]``) and ``LlamaModel.forward``
  appends ``hidden_states + residual`` *before* running layer ``i`` for each ``i`` in it, i.e. the input to
  layer ``id + 1`` = the output of layer ``id``: the ids are ``output_of``. Some other model files of newer
  releases add one only when the first id is 1 and otherwise use the ids as ``input_to``; a first id of 1
  reads the same under both rules (``native_config`` warns otherwise).
- norms: ``LlamaModel.forward`` (python/sglang/srt/models/llama_eagle3.py) returns the post-norm state for
  the logits and the pre-norm residual as the aux state fed to the next draft step, always; it reads no
  ``norm_output`` / ``norm_before_residual`` / ``fc_norm`` / ``norm_before_fc`` key and builds no
  ``fc_norm`` / ``input_norm`` module (their weights would be skipped by ``load_weights``); additional layers
  (``BasicDecoderLayer``) normalise with ``hidden_norm``, a key draftlab does not write for them.
  ``norm_output`` is therefore written with SpecForge's (and draftlab's) meaning, "final norm before
  lm_head", which is what SpecForge reads when it continues training from the directory.

vLLM (``speculative_config={"method": "eagle3", "model": <dir>}``), variant ``vllm``:

- aux ids: ``get_eagle3_aux_layers_from_config`` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)
  and ``GPUModelRunner._get_eagle3_aux_layers_from_config`` (vllm/v1/worker/gpu_model_runner.py) read the
  draft's *top-level* ``eagle_aux_hidden_state_layer_ids`` first (some builds then fall back to
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; without either, the target's
  ``get_eagle3_aux_hidden_state_layers()`` default ``(2, L // 2, L - 3)`` in vllm/model_executor/models/llama.py)
  and pass them unchanged to ``set_aux_hidden_state_layers``; ``LlamaModel.forward`` (llama.py) appends
  ``hidden_states + residual`` before running layer ``idx`` for ``idx`` in that tuple: the ids are
  ``input_to``. An ``output_of`` list such as SGLang's ``[1, 14, 26]`` would feed the outputs of layers
  0, 13 and 25, one layer early. ``LlamaModel.__init__`` (vllm/model_executor/models/llama_eagle3.py) takes
  only the *length* of ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the fc width).
- norms: ``LlamaModel.forward`` in llama_eagle3.py returns ``(post-norm, aux)`` with
  ``aux = post-norm if config.norm_output else pre-norm``; the proposer
  (``SpecDecodeBaseProposer.propose``, vllm/v1/spec_decode/llm_base_proposer.py) computes the logits from the
  first (so the final norm before lm_head is always applied) and feeds the second to the next draft step.
  ``norm_output`` thus means "feed the post-norm state back": a draftlab draft feeds the pre-norm state, so
  the variant writes ``false``. ``norm_before_residual`` (``LlamaDecoderLayer.__init__``, default False),
  ``fc_norm`` and ``norm_before_fc`` (top level, or ``eagle_config`` for the latter) are read as draftlab
  means them.
- weights: ``LlamaModel.load_weights`` / its ``WeightsMapper`` renames only ``midlayer.`` to ``layers.0.``;
  every other decoder layer must already be ``layers.{i}.`` (``additional_layers.*`` has no parameter to load
  into), so the variant writes later layers under vLLM's names.
- ``max_position_embeddings`` sizes the draft's RoPE and, through the draft model config's ``max_model_len``,
  caps the draft's context (``SpeculativeConfig._maybe_override_draft_max_model_len`` in
  vllm/config/speculative.py takes the smaller of draft and target): it is the target's value, not a default.

A draft with a ``sliding_window`` W (``Eagle3Config``) adds, in both variants, ``layer_types`` (every draft
layer ``sliding_attention``), ``use_sliding_window: true`` and ``sliding_window: W`` at the top level: vLLM's
``LlamaAttention`` (vllm/model_executor/models/llama.py) gives a draft layer ``config.sliding_window`` when its
``layer_types`` entry is ``sliding_attention``. Whether SGLang's EAGLE-3 model applies it is not checked here
(``native_config`` warns). A draft without a window writes none of these keys.

The speculators variant (``vllm serve <dir>``) is in ``draftlab.methods.eagle3.export.speculators``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.export.common import (
    NATIVE_ARCHITECTURE,
    assemble_draft,
    default_ids_from_target,
    dtype_name,
    export_tensors,
    is_target_factory,
    llama_layer_fields,
    native_to_vllm_key,
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
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

DRAFTLAB_BLOCK = "draftlab"
# 2: the block names the variant (engine) and the convention / meaning of every engine-read key.
DRAFTLAB_BLOCK_VERSION = 2
ENGINES = ("sglang", "vllm")
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
# What each variant's top-level ``norm_output`` means.
NORM_OUTPUT_MEANING = {"sglang": "final_norm_before_lm_head", "vllm": "post_norm_state_fed_back"}


def _check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown native variant {engine!r}; use one of {ENGINES}")
    return engine


def engine_aux_ids(config: Eagle3Config, engine: str) -> list[int]:
    """The draft's aux ids as ``engine`` reads them (SGLang: ``output_of``, vLLM: ``input_to``)."""
    conv = LayerConvention.OUTPUT_OF if _check_engine(engine) == "sglang" else LayerConvention.INPUT_TO
    return [to_convention(i, config.layer_convention, conv) for i in config.aux_layer_ids]


def _warn_unread(config: Eagle3Config, engine: str) -> None:
    c = config
    if engine == "sglang":
        aux = engine_aux_ids(c, "sglang")
        if aux and aux[0] != 1:
            log.warning("aux layer ids %s (output_of) do not start at 1: SGLang model files that add one only "
                        "when the first id is 1 would read them as input_to, i.e. one layer off. Check the draft "
                        "against the serving engine.", aux)
        unread = [name for name, on in (("fc_norm", c.fc_norm), ("norm_before_fc", c.norm_before_fc),
                                         ("norm_before_residual", c.norm_before_residual),
                                         ("num_layers > 1", c.num_layers > 1),
                                         ("norm_output=False", not c.norm_output)) if on]
        if unread:
            log.warning("SGLang's EAGLE-3 model (python/sglang/srt/models/llama_eagle3.py) does not build %s: it "
                        "would serve this draft differently from how it was trained (SpecForge reads the keys)",
                        ", ".join(unread))
        if c.sliding_window is not None:
            log.warning("sliding_window=%d is written as layer_types / sliding_window, but draftlab has not checked "
                        "that SGLang's EAGLE-3 model applies it: without it SGLang attends to the whole context",
                        c.sliding_window)


def native_config(config: Eagle3Config, *, torch_dtype: str, max_position_embeddings: int,
                  verifier_name: str | None = None, engine: str = "sglang") -> dict[str, Any]:
    """The native ``config.json`` dict for a draft with ``config``, in ``engine``'s reading (see the module doc)."""
    c = config
    _check_engine(engine)
    if engine == "vllm" and not c.norm_output:
        raise ValueError("vLLM's EAGLE-3 model always applies the final norm before lm_head; a draft with "
                         "norm_output=False (no final norm) cannot be exported for it")
    _warn_unread(c, engine)
    aux = engine_aux_ids(c, engine)
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
        # sglang: SpecForge's "final norm before lm_head"; vllm: "feed the post-norm state back" (never, here).
        "norm_output": c.norm_output if engine == "sglang" else False,
    })
    if c.sliding_window is not None:
        out.update(hf_window_keys(c.sliding_window, c.num_layers))
    if aux:
        if engine == "vllm":
            out[AUX_KEY] = list(aux)  # what every vLLM build reads first
        # vLLM takes only the length of this list (or, in builds that fall back to it, the same ids).
        out["eagle_config"] = {AUX_KEY: list(aux)}
    out[DRAFTLAB_BLOCK] = {
        "version": DRAFTLAB_BLOCK_VERSION,
        "engine": engine,
        # Convention of the ids in eagle3_config.aux_layer_ids (the draft's own) ...
        "layer_convention": c.layer_convention,
        # ... and of the engine-read id lists above.
        "eagle_config_layer_convention": (LayerConvention.OUTPUT_OF if engine == "sglang"
                                          else LayerConvention.INPUT_TO).value,
        "norm_output_meaning": NORM_OUTPUT_MEANING[engine],
        "eagle3_config": c.to_dict(),
        "verifier": verifier_name,
    }
    return out


def save_native(draft: Eagle3Draft, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                include_embedding: bool = False, verifier=None, max_position_embeddings: int | None = None,
                engine: str = "sglang", target=None) -> Path:
    """Write ``draft`` as a native EAGLE-3 directory (``config.json`` + ``model.safetensors``); returns it.

    engine                   ``sglang`` (SGLang / SpecForge reading, the default) or ``vllm`` (vLLM's
                             ``method: eagle3`` reading); see the module docstring.
    dtype                    cast floating weights (``None`` keeps the draft's dtype); d2t/t2d keep theirs.
    include_embedding        also write the frozen ``embed_tokens.weight`` (engines reuse the target's).
    verifier                 the target the draft serves with (a draftlab Target, an HF config, a dict, a
                             directory with a ``config.json``, or a name): its ``max_position_embeddings``
                             and name are recorded.
    max_position_embeddings  overrides the verifier's value (2048, with a warning, when neither is known).
    target                   the method registry's name for ``verifier`` (``export.<format>(draft, dir, target=)``).
    """
    verifier = verifier if verifier is not None else target
    cast = resolve_dtype(dtype)
    rename = native_to_vllm_key if _check_engine(engine) == "vllm" else (lambda k: k)
    tensors = export_tensors(draft, dtype=cast, include_embedding=include_embedding, rename=rename)
    info = verifier_info(verifier)
    config = native_config(draft.config, torch_dtype=dtype_name(tensors["fc.weight"].dtype),
                           max_position_embeddings=resolve_max_positions(max_position_embeddings, info),
                           verifier_name=info.get("name"), engine=engine)
    return write_hf_dir(out_dir, config, tensors)


def save_sglang(draft: Eagle3Draft, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                include_embedding: bool = False, verifier=None, max_position_embeddings: int | None = None,
                target=None) -> Path:
    """``save_native(..., engine="sglang")``: the directory SGLang and SpecForge read as trained."""
    return save_native(draft, out_dir, engine="sglang", dtype=dtype, include_embedding=include_embedding,
                       verifier=verifier, max_position_embeddings=max_position_embeddings, target=target)


def save_vllm(draft: Eagle3Draft, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
              include_embedding: bool = False, verifier=None, max_position_embeddings: int | None = None,
              target=None) -> Path:
    """``save_native(..., engine="vllm")``: the directory vLLM's ``method: eagle3`` reads as trained."""
    return save_native(draft, out_dir, engine="vllm", dtype=dtype, include_embedding=include_embedding,
                       verifier=verifier, max_position_embeddings=max_position_embeddings, target=target)


def native_engine(cfg: dict[str, Any]) -> str:
    """The variant a native config dict was written for: its draftlab block's, else by its keys (a top-level
    id list is vLLM's spelling, ``eagle_config`` alone SGLang's / SpecForge's)."""
    block = cfg.get(DRAFTLAB_BLOCK)
    if isinstance(block, dict) and block.get("engine") in ENGINES:
        return block["engine"]
    if isinstance(block, dict) and "eagle3_config" in block:
        return "sglang"  # version-1 blocks: the only variant draftlab wrote then
    return "vllm" if AUX_KEY in cfg else "sglang"


def _require(cfg: dict[str, Any], key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: config.json lacks required key '{key}'")
    return cfg[key]


def config_from_native_json(cfg: dict[str, Any], tensor_keys, *, source: str, target=None) -> Eagle3Config:
    """An ``Eagle3Config`` from a native config dict: the draftlab block if present, else the plain keys.

    Plain configs are read as their engine reads them (``native_engine``): SpecForge / EAGLE configs take aux
    ids from ``eagle_config`` as ``output_of`` and ``norm_output`` as the final norm before lm_head; vLLM-style
    configs take the top-level ids as ``input_to`` and ``norm_output`` as post-norm feedback (which draftlab
    drafts cannot reproduce, so ``true`` is refused). Without ids, the engines' defaults for ``target``'s
    depth apply (empty without a target). Variant switches missing from the config are inferred from the
    tensor keys (``fc_norm.*``, ``input_norm.weight``).
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
    if native_engine(cfg) == "vllm":
        if cfg.get("norm_output"):
            raise ValueError(f"{source}: vLLM's norm_output=true feeds the post-norm hidden state to the next draft "
                             "step; draftlab drafts feed the pre-norm state back and cannot reproduce it")
        convention, aux, norm_output = LayerConvention.INPUT_TO, cfg[AUX_KEY], True
    else:
        convention = LayerConvention.OUTPUT_OF
        aux = (cfg.get("eagle_config") or {}).get(AUX_KEY)
        norm_output = bool(cfg.get("norm_output", True))
    if aux is None:
        aux = default_ids_from_target(target, convention)
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
            layer_convention=convention.value,
            fc_norm=bool(cfg.get("fc_norm", "fc_norm.0.weight" in keys)),
            norm_before_fc=bool(cfg.get("norm_before_fc", "input_norm.weight" in keys)),
            # Native EAGLE-3 / SpecForge drafts add the raw hidden state to the residual (vLLM's default too).
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_output=norm_output,
            sliding_window=window_from_hf(cfg, int(cfg.get("num_hidden_layers", 1))),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e


def load_native(path: str | Path, *, target=None, require_embedding: bool = True,
                dtype: str | torch.dtype | None = None, device: torch.device | str | None = None) -> Eagle3Draft:
    """Load a native EAGLE-3 directory of either variant (draftlab's own, a SpecForge / EAGLE checkpoint, or a
    vLLM-style config).

    Weights load strictly (missing / unexpected keys raise ``ValueError`` naming them). The embedding is
    taken from the file if present, else from ``target`` (a Target, or a zero-argument function returning
    one); with neither, ``require_embedding=True`` raises, ``False`` leaves it NaN-filled. ``dtype``
    defaults to the file's; ``device`` to the target's (the CPU without one), see ``assemble_draft``.
    """
    source = str(path)
    cfg = read_config(path)
    # The vLLM variant names layers after the first ``layers.{i}.`` (vLLM's names); ``midlayer.`` stays.
    tensors = {speculators_to_native_key(k): v for k, v in read_tensors(path).items()}
    real_target = None if is_target_factory(target) else target
    config = config_from_native_json(cfg, tensors.keys(), source=source, target=real_target)
    return assemble_draft(config, tensors, source=source, target=target, require_embedding=require_embedding,
                          dtype=dtype, device=device)


__all__ = ["AUX_KEY", "DRAFTLAB_BLOCK", "ENGINES", "config_from_native_json", "engine_aux_ids", "load_native",
           "native_config", "native_engine", "save_native", "save_sglang", "save_vllm"]
