"""The DFlash HF format (z-lab ``DFlashDraftModel``, SGLang ``--speculative-algorithm DFLASH``): save, validate, load.

A directory with

- ``config.json``: a Qwen3 decoder config (``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``,
  the layer sizes, ``num_target_layers``) plus ``dflash_config: {mask_token_id, target_layer_ids,
  block_size}``. ``target_layer_ids`` count ``output_of`` (the reference reads HF ``hidden_states[i + 1]``).
  ``block_size`` is also written at the top level, where older loaders look; both RoPE spellings
  (``rope_theta`` for transformers 4 / SGLang, ``rope_parameters`` for transformers 5) are written.
  A draft with a ``sliding_window`` W marks every layer ``sliding_attention`` in ``layer_types`` and writes
  ``use_sliding_window: true``, ``sliding_window: W`` and ``max_window_layers: 0`` (older Qwen3 readers derive
  the sliding layers from it), as vLLM's ``qwen3_dflash.py`` reads them; ``is_causal: false`` stays, which vLLM
  needs to keep sliding DFlash layers bidirectional (it makes them causal when the key is absent).
  A ``draftlab`` block holds the full draft config (and the convention its taps were named in), so
  draftlab reloads the file exactly; engines ignore it.
- ``model.safetensors``: the draft's own weights under the reference names (``fc``, ``hidden_norm``,
  ``layers.{i}.*``, ``norm``). The target's embedding and LM head are excluded: engines use the target's.

``save`` writes into a temporary directory beside ``out_dir``, validates it and only then renames it into
place, so a crash or an invalid draft never leaves a half-written export where a server would find it.
``validate`` lists every problem it finds (empty = valid); ``load`` refuses anything ``validate`` rejects.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from draftlab.methods.dflash.config import DFlashConfig, default_taps
from draftlab.methods.dflash.model import DFlashDraft
from draftlab.nn import rope_from_hf_config
from draftlab.nn.placement import target_device
from draftlab.nn.window import SLIDING, hf_window_keys, window_from_hf
from draftlab.targets.base import LayerConvention
from draftlab.utils.atomic import atomic_dir

MODEL_TYPE = "qwen3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFTLAB_BLOCK = "draftlab"
DRAFTLAB_BLOCK_VERSION = 1
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768
# Keys a careless export would carry: the target's own tensors, which the format leaves out.
_TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight", "embed_weight", "lm_head_weight")


# ------------------------------------------------------------------------------------------------------
# layout


def expected_shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash export with ``c`` and its shape (a successor's own tensors included:
    ``c.extra_shapes()``)."""
    d, ff, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_out, kv_out = c.num_heads * hd, c.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (d, c.num_taps * d), "hidden_norm.weight": (d,),
                                          "norm.weight": (d,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q_out, d),
            p + "self_attn.k_proj.weight": (kv_out, d),
            p + "self_attn.v_proj.weight": (kv_out, d),
            p + "self_attn.o_proj.weight": (d, q_out),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    shapes.update(c.extra_shapes())
    return shapes


def _target_info(target) -> dict[str, Any]:
    cfg = getattr(getattr(target, "model", None), "config", None)
    if cfg is None:
        return {}
    keys = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    info = {k: getattr(cfg, k, None) for k in keys}
    info["name"] = getattr(target, "name", None) or getattr(cfg, "_name_or_path", None)
    return {k: v for k, v in info.items() if v is not None}


def hf_config(c: DFlashConfig, *, torch_dtype: str, target=None, max_position_embeddings: int | None = None
              ) -> dict[str, Any]:
    """The ``config.json`` dict of a draft with config ``c`` (``target``: where positions / token ids come from)."""
    info = _target_info(target)
    taps = c.taps_in(LayerConvention.OUTPUT_OF)
    rope_parameters = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    out: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": MODEL_TYPE,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(max_position_embeddings or info.get("max_position_embeddings")
                                       or DEFAULT_MAX_POSITION_EMBEDDINGS),
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        # Block rows attend bidirectionally; every layer is full attention.
        "is_causal": False,
        "layer_types": ["full_attention"] * c.num_layers,
        "use_sliding_window": False,
        "use_cache": False,
        "torch_dtype": torch_dtype,
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": taps, "block_size": c.block_size,
                          **c.extra_dflash_config()},
    }
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    if c.sliding_window is not None:
        out.update(hf_window_keys(c.sliding_window, c.num_layers), max_window_layers=0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in info:
            out[key] = info[key]
    out.update(c.extra_hf_keys())
    out[DRAFTLAB_BLOCK] = {"version": DRAFTLAB_BLOCK_VERSION, "dflash_config": c.to_dict(),
                           "target_layer_ids_convention": LayerConvention.OUTPUT_OF.value, "verifier": info.get("name")}
    return out


# ------------------------------------------------------------------------------------------------------
# save


def save(draft: DFlashDraft, out_dir: str | Path, *, target=None, dtype: str | torch.dtype | None = None,
         max_position_embeddings: int | None = None) -> Path:
    """Write ``draft`` as a DFlash HF directory at ``out_dir`` (atomically, validated) and return it.

    dtype      cast the floating weights (None keeps the draft's); ``target`` supplies
               ``max_position_embeddings`` and token ids, and is checked against the draft.
    """
    from safetensors.torch import save_file

    from draftlab.targets.hf import resolve_dtype

    cast = resolve_dtype(dtype) if dtype is not None else None
    tensors = {}
    for key, t in draft.state_dict().items():
        t = t.detach().to("cpu")
        # clone: safetensors refuses views into larger storages.
        tensors[key] = (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous().clone()
    torch_dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    config = hf_config(draft.config, torch_dtype=torch_dtype, target=target,
                       max_position_embeddings=max_position_embeddings)

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        problems = validate(tmp, target=target, config_class=type(draft.config))
        if problems:
            raise ValueError(f"refusing to write an invalid {draft.config.architecture} export to {out}:\n  - " + "\n  - ".join(problems))
    return out


# ------------------------------------------------------------------------------------------------------
# validate


def _int(cfg: dict, key: str, problems: list[str], *, where: str = "config.json", minimum: int = 1) -> int | None:
    v = cfg.get(key)
    if v is None:
        problems.append(f"{where} lacks '{key}'")
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        problems.append(f"{where} '{key}' must be an integer >= {minimum}, got {v!r}")
        return None
    return v


def config_from_hf(cfg: dict[str, Any], config_class: type[DFlashConfig] = DFlashConfig) -> DFlashConfig:
    """A ``config_class`` from a ``config.json`` dict: the draftlab block if present, else the plain keys.

    Plain (z-lab) configs name their taps in ``dflash_config.target_layer_ids`` (output_of), falling back
    to DFlash's defaults for ``num_target_layers`` and the draft depth, as the reference loader does.
    """
    block = cfg.get(DRAFTLAB_BLOCK)
    if isinstance(block, dict) and isinstance(block.get("dflash_config"), dict):
        return config_class.from_dict(dict(block["dflash_config"]))
    dc = cfg.get("dflash_config") or {}
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    n_target = int(cfg.get("num_target_layers") or 0)
    taps = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        taps = default_taps(n_target, layers)
    rope_theta, rope_scaling = rope_from_hf_config(SimpleNamespace(**cfg))
    return config_class(
        **config_class.fields_from_dflash_config(dc),
        hidden_size=d, intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or d // heads),
        vocab_size=int(cfg["vocab_size"]), num_layers=layers,
        block_size=int(dc.get("block_size", cfg.get("block_size", 16))), mask_token_id=int(dc["mask_token_id"]),
        target_layer_ids=list(taps), layer_convention=LayerConvention.OUTPUT_OF.value, num_target_layers=n_target,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
        sliding_window=_plain_window(cfg, dc, layers),
    )


def _plain_window(cfg: dict[str, Any], dc: dict[str, Any], layers: int) -> int | None:
    """A plain config's sliding window: ``layer_types`` / ``use_sliding_window`` / ``sliding_window`` (``nn.window``),
    or vLLM's DFlash spelling ``dflash_config.use_swa`` (every layer) with ``swa_window_size``."""
    types = cfg.get("layer_types")
    if dc.get("use_swa") and SLIDING not in (types or ()):
        types = [SLIDING] * layers  # vLLM: use_swa slides every layer, even an all-full layer_types
    size = dc.get("swa_window_size", cfg.get("sliding_window"))
    return window_from_hf({**cfg, "layer_types": types, "sliding_window": size}, layers)


def _check_config(cfg: dict[str, Any], problems: list[str], config_class: type[DFlashConfig]) -> DFlashConfig | None:
    archs, arch = cfg.get("architectures"), config_class.architecture
    if not isinstance(archs, list) or arch not in archs:
        problems.append(f"config.json 'architectures' must list '{arch}', got {archs!r}")
    if cfg.get("model_type") != MODEL_TYPE:
        problems.append(f"config.json 'model_type' must be '{MODEL_TYPE}' (DFlash layers are Qwen3 layers), "
                        f"got {cfg.get('model_type')!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json 'hidden_act' must be 'silu' (SGLang's DFlash MLP), got {cfg.get('hidden_act')!r}")
    sizes = {k: _int(cfg, k, problems) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size")}
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads and kv and heads % kv:
        problems.append(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
    n_target = _int(cfg, "num_target_layers", problems)
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        problems.append("config.json lacks the 'dflash_config' object (mask_token_id, target_layer_ids, block_size)")
        return None
    where = "dflash_config"
    mask = dc.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        problems.append(f"dflash_config 'mask_token_id' must be an integer, got {mask!r}")
    elif sizes["vocab_size"] and not 0 <= mask < sizes["vocab_size"]:
        problems.append(f"dflash_config 'mask_token_id' {mask} is outside the vocabulary [0, {sizes['vocab_size']})")
    taps = dc.get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(isinstance(i, int) and not isinstance(i, bool) for i in taps):
        problems.append(f"dflash_config 'target_layer_ids' must be a non-empty list of integers, got {taps!r}")
    elif n_target and any(not 0 <= i < n_target for i in taps):
        problems.append(f"dflash_config 'target_layer_ids' {taps} are not all layers of a {n_target}-layer target")
    block = _int(dc, "block_size", problems, where=where, minimum=2)
    if block is not None and cfg.get("block_size", block) != block:
        problems.append(f"top-level block_size {cfg.get('block_size')} disagrees with dflash_config block_size {block}")
    if problems:
        return None
    try:
        c = config_from_hf(cfg, config_class)
    except KeyError as e:
        problems.append(f"dflash_config lacks {e} (a {arch} field)")
        return None
    except (TypeError, ValueError) as e:
        problems.append(f"config.json does not describe a {arch} draft: {e}")
        return None
    # The draftlab block must describe the same draft as the keys engines read.
    seen = {"hidden_size": sizes["hidden_size"], "intermediate_size": sizes["intermediate_size"],
            "num_heads": heads, "num_kv_heads": kv, "head_dim": sizes["head_dim"],
            "num_layers": sizes["num_hidden_layers"], "vocab_size": sizes["vocab_size"],
            "num_target_layers": n_target, "mask_token_id": mask, "block_size": block}
    for k, v in seen.items():
        if getattr(c, k) != v:
            problems.append(f"draftlab block {k}={getattr(c, k)} disagrees with config.json ({v})")
    if c.taps_in(LayerConvention.OUTPUT_OF) != taps:
        problems.append(f"draftlab block taps {c.taps_in(LayerConvention.OUTPUT_OF)} (output_of) disagree with "
                        f"dflash_config target_layer_ids {taps}")
    for k, v in c.extra_dflash_config().items():
        if dc.get(k) != v:
            problems.append(f"dflash_config '{k}' is {dc.get(k)!r} where the draft has {v!r}")
    _check_window(cfg, dc, c, problems)
    return c


def _check_window(cfg: dict[str, Any], dc: dict[str, Any], c: DFlashConfig, problems: list[str]) -> None:
    """The keys vLLM reads for the attention window say the draft's, and leave its block bidirectional."""
    try:
        read = _plain_window(cfg, dc, c.num_layers)
    except ValueError as e:
        problems.append(f"config.json: {e}")
        return
    if read != c.sliding_window:
        problems.append(f"config.json's layer_types / sliding_window give the layers a window of {read}, the draft "
                        f"has {c.sliding_window} (None: full attention)")
    if c.sliding_window is None:
        return
    if cfg.get("use_sliding_window") is not True:
        problems.append("config.json 'use_sliding_window' must be true (Qwen3's HF config drops sliding_window "
                        "without it)")
    if cfg.get("is_causal") is not False:
        problems.append("config.json 'is_causal' must be false: vLLM runs DFlash's sliding layers causally "
                        "otherwise, and the draft's block rows attend bidirectionally")


def _check_weights(path: Path, c: DFlashConfig, torch_dtype: str | None, problems: list[str]) -> None:
    from safetensors import safe_open

    file = path / WEIGHTS_FILE
    if not file.is_file():
        problems.append(f"no {WEIGHTS_FILE} in {path}")
        return
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several unrelated types for damaged files
        problems.append(f"cannot read {file}: {e}")
        return
    expected = expected_shapes(c)
    for k in sorted(set(tensors) - set(expected)):
        why = (" (the target's embedding / LM head must not be exported: engines use the target's own)"
               if k.endswith(_TARGET_KEYS) else "")
        problems.append(f"unexpected tensor '{k}'{why}")
    for k in sorted(set(expected) - set(tensors)):
        problems.append(f"missing tensor '{k}' {expected[k]}")
    dtypes = set()
    for k, shape in expected.items():
        t = tensors.get(k)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(f"tensor '{k}' has shape {tuple(t.shape)}, the config needs {shape}")
        elif not torch.isfinite(t.float()).all():
            problems.append(f"tensor '{k}' holds non-finite values")
        dtypes.add(str(t.dtype).removeprefix("torch."))
    if len(dtypes) > 1:
        problems.append(f"weights mix dtypes {sorted(dtypes)}")
    elif torch_dtype and dtypes and dtypes != {torch_dtype}:
        problems.append(f"config.json torch_dtype '{torch_dtype}' but the weights are {dtypes.pop()}")


def _check_target(c: DFlashConfig, target, problems: list[str]) -> None:
    g = target.geometry
    if c.hidden_size != g.hidden_size:
        problems.append(f"hidden_size {c.hidden_size} != the target's {g.hidden_size} (DFlash shares the target's "
                        "embedding and LM head)")
    if c.vocab_size != g.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != the target's {g.vocab_size}")
    if c.num_target_layers and c.num_target_layers != g.num_layers:
        problems.append(f"num_target_layers {c.num_target_layers} != the target's {g.num_layers} layers")
    bad = [i for i in c.taps_in(LayerConvention.OUTPUT_OF) if not 0 <= i < g.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} are not layers of the {g.num_layers}-layer target")


def validate(path: str | Path, *, target=None, config_class: type[DFlashConfig] = DFlashConfig) -> list[str]:
    """Every problem an engine or the DFlash loader would hit with the export at ``path`` (empty = valid).

    With ``target``, also checks that the draft fits it (width, vocabulary, depth of the taps).
    """
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        return [f"no {CONFIG_FILE} in {path}"]
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        return [f"{file} is not valid JSON: {e}"]
    if not isinstance(cfg, dict):
        return [f"{file} must hold a JSON object"]
    problems: list[str] = []
    c = _check_config(cfg, problems, config_class)
    config_class.check_hf_keys(cfg, problems)
    if c is None:
        return problems
    _check_weights(path, c, cfg.get("torch_dtype") or cfg.get("dtype"), problems)
    if target is not None:
        _check_target(c, target, problems)
    return problems


def check_valid(path: str | Path, *, target=None, config_class: type[DFlashConfig] = DFlashConfig) -> None:
    """``validate`` that raises ``ValueError`` listing the problems."""
    problems = validate(path, target=target, config_class=config_class)
    if problems:
        raise ValueError(f"{path} is not a valid DFlash export ({config_class.architecture}):\n  - "
                         + "\n  - ".join(problems))


# ------------------------------------------------------------------------------------------------------
# load


def load(path: str | Path, *, target, dtype: str | torch.dtype | None = None,
         draft_class: type[DFlashDraft] = DFlashDraft) -> DFlashDraft:
    """The draft saved at ``path`` (validated first), on ``target``'s device, sharing its embedding and LM head.

    ``dtype`` defaults to the file's. Weights load strictly. ``draft_class``: a successor of DFlash reads its
    own format through here (its ``config_class`` names the architecture and the extra fields).
    """
    from safetensors.torch import load_file

    from draftlab.targets.hf import resolve_dtype

    config_class = draft_class.config_class
    check_valid(path, target=target, config_class=config_class)
    path = Path(path)
    config = config_from_hf(json.loads((path / CONFIG_FILE).read_text()), config_class)
    tensors = load_file(str(path / WEIGHTS_FILE))
    draft = draft_class(config)
    dtype = resolve_dtype(dtype) if dtype is not None else tensors["fc.weight"].dtype
    draft.to(device=target_device(target), dtype=dtype)
    draft.load_state_dict(tensors, strict=True)
    draft.share_target_weights(target)
    return draft


def chain_knobs(k: int) -> dict[str, int]:
    """The drafter knobs of a served DFlash chain of ``k`` tokens: one block of ``k + 1`` slots (the engines put
    the bonus token's query first, then ``k`` mask queries, as the drafter's root + ``block_size - 1``)."""
    return {"block_size": int(k) + 1}
