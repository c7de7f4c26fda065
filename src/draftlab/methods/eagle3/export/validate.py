"""Validators for exported EAGLE-3 directories: every problem a serving engine would trip over, as text.

``validate_sglang`` / ``validate_vllm`` (the two native variants, ``validate_native`` picks the one its
draftlab block names) and ``validate_speculators`` return a list of problems (empty = valid) covering the
config keys, the architecture, the tensor key set, every shape against the config, dtypes, the ``d2t``/``t2d``
vocabulary mapping and the aux layer ids. For draftlab's own exports they also check the per-engine meaning
of the engine-read keys against the draftlab block: that the ids the engine reads name the draft's taps in
the engine's convention (SGLang: ``output_of``; vLLM: ``input_to`` = ``output_of`` + 1), and
that ``norm_output`` says what the engine must do (SGLang / SpecForge: apply the final norm iff the draft
does; vLLM: ``false``, the pre-norm state is fed back). ``check_valid`` raises one ``ValueError`` listing
them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.export.common import (
    BIN_FILE,
    EMBED_KEY,
    FOREIGN_PREFIXES,
    NATIVE_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    Dims,
    expected_shapes,
    native_layer_prefix,
    read_config,
    speculators_layer_prefix,
    vllm_layer_prefix,
    weights_file,
)
from draftlab.methods.eagle3.export.native import native_engine
from draftlab.nn.window import window_from_hf, window_problems
from draftlab.targets.base import LayerConvention, to_convention

FORMATS = ("sglang", "vllm", "speculators", "native")
_NATIVE_ENGINES = ("sglang", "vllm")
_AUX_KEY = "eagle_aux_hidden_state_layer_ids"

# safetensors dtype tags -> torch dtype names
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class _Problems(list):
    def add(self, msg: str) -> None:
        self.append(msg)


def _get_int(cfg: dict, key: str, where: str, problems: _Problems, *, required: bool = True,
             default: int | None = None, minimum: int = 1) -> int | None:
    if key not in cfg or cfg[key] is None:
        if required:
            problems.add(f"{where}: missing required key '{key}'")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        problems.add(f"{where}: '{key}' must be an integer, got {v!r}")
        return default
    if v < minimum:
        problems.add(f"{where}: '{key}' must be >= {minimum}, got {v}")
        return default
    return v


def _get_bool(cfg: dict, key: str, where: str, problems: _Problems, *, required: bool = False,
              default: bool = False) -> bool:
    if key not in cfg:
        if required:
            problems.add(f"{where}: missing required key '{key}' (must be written explicitly)")
        return default
    v = cfg[key]
    if not isinstance(v, bool):
        problems.add(f"{where}: '{key}' must be true or false, got {v!r}")
        return default
    return v


def _check_aux_ids(ids: Any, where: str, problems: _Problems) -> list[int] | None:
    if ids is None:
        problems.add(f"{where}: missing (engines would fall back to their own defaults, whose layer "
                     "convention differs between projects)")
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.add(f"{where}: must be a list of integers, got {ids!r}")
        return None
    if len(ids) != 3 or len(set(ids)) != 3:
        problems.add(f"{where}: must be exactly 3 distinct layer ids, got {ids}")
    if any(i < 0 for i in ids):
        problems.add(f"{where}: layer ids must be non-negative, got {ids}")
    return ids


def _check_architecture(cfg: dict, expected: str, problems: _Problems) -> None:
    arch = cfg.get("architectures")
    if arch is None:
        problems.add("config: missing required key 'architectures'")
    elif arch != [expected]:
        problems.add(f"config: architectures is {arch!r}, expected ['{expected}']")


def _dims(cfg: dict, where: str, problems: _Problems, *, flags: dict) -> Dims | None:
    before = len(problems)
    d = _get_int(cfg, "hidden_size", where, problems)
    heads = _get_int(cfg, "num_attention_heads", where, problems)
    ff = _get_int(cfg, "intermediate_size", where, problems)
    kv = _get_int(cfg, "num_key_value_heads", where, problems, required=False, default=heads)
    hd = _get_int(cfg, "head_dim", where, problems, required=False,
                  default=(d // heads if d and heads else None))
    vocab = _get_int(cfg, "vocab_size", where, problems)
    _get_int(cfg, "max_position_embeddings", where, problems, required=False)
    eps = cfg.get("rms_norm_eps")
    if eps is None:
        problems.add(f"{where}: missing required key 'rms_norm_eps'")
    elif isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        problems.add(f"{where}: 'rms_norm_eps' must be a positive number, got {eps!r}")
    if heads and kv and heads % kv:
        problems.add(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
    if len(problems) > before:
        return None
    return Dims(hidden_size=d, intermediate_size=ff, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                vocab_size=vocab, **flags)


def _tensor_meta(path: Path, problems: _Problems) -> tuple[dict[str, tuple[tuple[int, ...], str]],
                                                            dict[str, torch.Tensor]]:
    """key -> (shape, dtype name) for every tensor, plus the loaded d2t / t2d (without reading the rest)."""
    try:
        file = weights_file(path)
    except FileNotFoundError as e:
        problems.add(str(e))
        return {}, {}
    meta, small = {}, {}
    try:
        if file.name == BIN_FILE:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for k, t in sd.items():
                meta[k] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            small = {k: sd[k] for k in ("d2t", "t2d") if k in sd}
        else:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    tag = sl.get_dtype()
                    meta[k] = (tuple(sl.get_shape()), _ST_DTYPES.get(tag, tag.lower()))
                small = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in meta}
    except Exception as e:  # damaged files raise assorted error types
        problems.add(f"cannot read weights from {file}: {e}")
        return {}, {}
    return meta, small


def _check_tensors(meta: dict, small: dict, dims: Dims | None, layer_prefix, torch_dtype: Any,
                   problems: _Problems) -> None:
    for k in sorted(meta):
        for p in FOREIGN_PREFIXES:
            if k.startswith(p):
                problems.add(f"tensor '{k}' has a leftover '{p}' prefix (engines look for '{k.removeprefix(p)}')")
                break
    required = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                layer_prefix(0) + "self_attn.q_proj.weight")
    if dims is None:
        # Without usable sizes only the presence of the core keys can be checked.
        for k in required:
            if k not in meta:
                problems.add(f"missing tensor '{k}'")
        return
    expected = expected_shapes(dims, layer_prefix)
    for k, shape in expected.items():
        if k not in meta:
            problems.add(f"missing tensor '{k}' (expected shape {list(shape)})")
        elif meta[k][0] != shape:
            problems.add(f"tensor '{k}' has shape {list(meta[k][0])}, the config implies {list(shape)}")
    for k in sorted(set(meta) - set(expected) - {EMBED_KEY}):
        if any(k.startswith(p) for p in FOREIGN_PREFIXES):
            continue  # reported above
        hint = ""
        if k.startswith("fc_norm.") and not dims.fc_norm:
            hint = " (config fc_norm is false)"
        elif k == "input_norm.weight" and not dims.norm_before_fc:
            hint = " (config norm_before_fc is false)"
        problems.add(f"unexpected tensor '{k}'{hint}")
    if EMBED_KEY in meta and meta[EMBED_KEY][0] != (dims.vocab_size, dims.hidden_size):
        problems.add(f"tensor '{EMBED_KEY}' has shape {list(meta[EMBED_KEY][0])}, the config implies "
                     f"{[dims.vocab_size, dims.hidden_size]}")

    if "d2t" in meta and meta["d2t"][1] != "int64":
        problems.add(f"tensor 'd2t' has dtype {meta['d2t'][1]}, expected int64")
    if "t2d" in meta and meta["t2d"][1] != "bool":
        problems.add(f"tensor 't2d' has dtype {meta['t2d'][1]}, expected bool")
    float_dtypes = {dt for k, (_, dt) in meta.items() if k not in ("d2t", "t2d")}
    if len(float_dtypes) > 1:
        problems.add(f"weights mix dtypes {sorted(float_dtypes)}")
    if torch_dtype is not None and "fc.weight" in meta and meta["fc.weight"][1] != torch_dtype:
        problems.add(f"config torch_dtype is {torch_dtype!r} but the weights are {meta['fc.weight'][1]}")
    _check_vocab_mapping(small, dims, problems)


def _check_vocab_mapping(small: dict, dims: Dims, problems: _Problems) -> None:
    d2t, t2d = small.get("d2t"), small.get("t2d")
    if d2t is None or t2d is None:
        return
    if tuple(d2t.shape) != (dims.draft_vocab_size,) or tuple(t2d.shape) != (dims.vocab_size,):
        return  # already reported as a shape problem
    if d2t.is_floating_point() or t2d.is_floating_point():
        return  # already reported as a dtype problem
    ids = d2t.long() + torch.arange(d2t.numel())  # [V_d] target id of each draft id
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= dims.vocab_size):
        problems.add(f"d2t maps draft ids outside the target vocabulary [0, {dims.vocab_size}) "
                     f"(d2t + arange spans [{int(ids.min())}, {int(ids.max())}])")
        return
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        first = int((ids[1:] <= ids[:-1]).nonzero()[0])
        problems.add(f"d2t + arange is not strictly increasing (draft ids {first} and {first + 1} map to target "
                     f"ids {int(ids[first])} and {int(ids[first + 1])}); engines expect ascending target ids")
        return
    t2d = t2d.bool()
    if int(t2d.sum()) != dims.draft_vocab_size or not bool(t2d[ids].all()):
        problems.add(f"t2d does not match d2t: t2d marks {int(t2d.sum())} target tokens, d2t maps "
                     f"{dims.draft_vocab_size}, {int((~t2d[ids]).sum())} of them unmarked in t2d")


def _output_of(c: Eagle3Config) -> list[int]:
    return [to_convention(i, c.layer_convention, LayerConvention.OUTPUT_OF) for i in c.aux_layer_ids]


def _draftlab_block_problems(cfg: dict, engine: str, aux: list[int] | None, problems: _Problems) -> None:
    """The draftlab block against the keys ``engine`` reads (``aux``: the id list that engine reads)."""
    block = cfg.get("draftlab")
    if block is None:
        return
    try:
        c = Eagle3Config.from_dict(dict(block["eagle3_config"]))
    except Exception as e:
        problems.add(f"config: draftlab block is unusable: {e}")
        return
    written_for = block.get("engine", "sglang")  # version-1 blocks predate the vllm variant
    if written_for != engine:
        problems.add(f"config: the draftlab block says this directory was written for {written_for!r}, "
                     f"not {engine!r}: {engine} would read its aux ids / norm_output differently")
    pairs = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
             "target_hidden_size": c.target_hidden_size, "num_hidden_layers": c.num_layers, "fc_norm": c.fc_norm,
             "norm_before_fc": c.norm_before_fc, "norm_before_residual": c.norm_before_residual}
    for key, v in pairs.items():
        if key in cfg and cfg[key] != v:
            problems.add(f"config: '{key}' is {cfg[key]!r} but the draftlab block says {v!r}")
    if block.get("layer_convention") not in (None, c.layer_convention):
        problems.add(f"config: draftlab layer_convention {block.get('layer_convention')!r} disagrees with its "
                     f"eagle3_config ({c.layer_convention!r})")
    problems.extend(window_problems(cfg, c.sliding_window, c.num_layers, "config"))
    norm_output = cfg.get("norm_output")
    if engine == "sglang":
        # SpecForge's reading: norm_output = the final norm before lm_head, as the draft was trained.
        if "norm_output" in cfg and norm_output != c.norm_output:
            problems.add(f"config: 'norm_output' is {norm_output!r} but the draftlab block says {c.norm_output!r} "
                         "(SpecForge reads it as the final norm before lm_head)")
        if aux is not None and c.aux_layer_ids and _output_of(c) != aux:
            problems.add(f"config: eagle_config ids {aux} are not the draftlab ids {c.aux_layer_ids} "
                         f"({c.layer_convention}) in output_of ({_output_of(c)}), which SGLang reads")
        top = cfg.get(_AUX_KEY)
        if top is not None and top != [i + 1 for i in _output_of(c)]:
            problems.add(f"config: top-level {_AUX_KEY} {top} would make vLLM capture other layers than the "
                         f"draftlab ids (input_to {[i + 1 for i in _output_of(c)]})")
        return
    # vLLM: norm_output = feed the post-norm state back; draftlab drafts feed the pre-norm state.
    if norm_output is not False:
        problems.add(f"config: 'norm_output' is {norm_output!r}; vLLM reads true as 'feed the post-norm hidden state "
                     "to the next draft step', but draftlab drafts feed the pre-norm state back: it must be false")
    if not c.norm_output:
        problems.add("config: the draftlab block's draft has no final norm before lm_head (norm_output=False), "
                     "which vLLM always applies")
    if aux is not None and c.aux_layer_ids:
        want = [i + 1 for i in _output_of(c)]
        if aux != want:
            problems.add(f"config: {_AUX_KEY} {aux} are not the draftlab ids {c.aux_layer_ids} ({c.layer_convention}) "
                         f"as vLLM reads them: input_to = output_of + 1 = {want}")


def _window_readable(layer_cfg: dict, where: str, problems: _Problems) -> None:
    """``layer_types`` / ``sliding_window`` of ``layer_cfg`` say one window for every layer, or none."""
    layers = layer_cfg.get("num_hidden_layers", 1)
    if isinstance(layers, int) and not isinstance(layers, bool):
        try:
            window_from_hf(layer_cfg, layers)
        except ValueError as e:
            problems.add(f"{where}: {e}")


def _open_config(path: Path, problems: _Problems) -> dict | None:
    if not path.is_dir():
        problems.add(f"{path} is not a directory")
        return None
    try:
        return read_config(path)
    except (FileNotFoundError, ValueError) as e:
        problems.add(str(e))
        return None


def _draft_dims(cfg: dict, layer_cfg: dict, where: str, flags: dict, problems: _Problems) -> Dims | None:
    """Dims from the layer fields (``layer_cfg``, found at ``where``) plus the draft fields at the top level.

    None (with the reasons in ``problems``) when any of them is missing or inconsistent.
    """
    base = _dims(layer_cfg, where, problems, flags=dict(draft_vocab_size=0, target_hidden_size=0, num_layers=1,
                                                        **flags))
    dvs = _get_int(cfg, "draft_vocab_size", "config", problems)
    layers = _get_int(layer_cfg, "num_hidden_layers", where, problems)
    hidden = layer_cfg.get("hidden_size")
    dt = _get_int(cfg, "target_hidden_size", "config", problems, required=False,
                  default=hidden if isinstance(hidden, int) else None)
    if base is None or dvs is None or layers is None or dt is None:
        return None
    if dvs > base.vocab_size:
        problems.add(f"config: draft_vocab_size {dvs} exceeds vocab_size {base.vocab_size}")
    return Dims(**{**base.__dict__, "draft_vocab_size": dvs, "target_hidden_size": dt, "num_layers": layers})


def validate_native(path: str | Path, engine: str | None = None) -> list[str]:
    """Problems that keep ``path`` from being a valid native EAGLE-3 directory for ``engine`` (``sglang`` or
    ``vllm``; default: the variant it was written for, see ``native.native_engine``). Empty = valid."""
    path, problems = Path(path), _Problems()
    cfg = _open_config(path, problems)
    if cfg is None:
        return list(problems)
    if engine is None:
        engine = native_engine(cfg)
    if engine not in _NATIVE_ENGINES:
        raise ValueError(f"unknown native variant {engine!r}; use one of {_NATIVE_ENGINES}")
    _check_architecture(cfg, NATIVE_ARCHITECTURE, problems)
    if cfg.get("model_type") != "llama":
        problems.add(f"config: model_type is {cfg.get('model_type')!r}, expected 'llama'")
    flags = dict(fc_norm=_get_bool(cfg, "fc_norm", "config", problems),
                 norm_before_fc=_get_bool(cfg, "norm_before_fc", "config", problems))
    for key in ("norm_before_residual", "norm_output"):
        _get_bool(cfg, key, "config", problems)
    if flags["fc_norm"] and flags["norm_before_fc"]:
        problems.add("config: fc_norm and norm_before_fc are mutually exclusive")
    dims = _draft_dims(cfg, cfg, "config", flags, problems)
    eagle = cfg.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        problems.add(f"config: eagle_config must be an object, got {eagle!r}")
        eagle = None
    nested = (eagle or {}).get(_AUX_KEY)
    if engine == "sglang":
        # SGLang's ModelRunner reads only eagle_config's list (output_of).
        aux = _check_aux_ids(nested, f"config: eagle_config.{_AUX_KEY}", problems)
    else:
        # vLLM reads the top-level list first (input_to); builds that fall back to eagle_config read it the same.
        aux = _check_aux_ids(cfg.get(_AUX_KEY), f"config: {_AUX_KEY} (top level, read by vLLM)", problems)
        if nested is not None and aux is not None and nested != aux:
            problems.add(f"config: eagle_config.{_AUX_KEY} {nested} differs from the top-level {aux}: vLLM builds "
                         "that fall back to eagle_config would read other layers")
    _draftlab_block_problems(cfg, engine, aux, problems)
    if cfg.get("draftlab") is None:
        _window_readable(cfg, "config", problems)
    meta, small = _tensor_meta(path, problems)
    if meta:
        prefix = native_layer_prefix if engine == "sglang" else vllm_layer_prefix
        _check_tensors(meta, small, dims, prefix, cfg.get("torch_dtype"), problems)
    return list(problems)


def validate_sglang(path: str | Path) -> list[str]:
    """Problems of ``path`` as the native directory SGLang / SpecForge read (empty = valid)."""
    return validate_native(path, "sglang")


def validate_vllm(path: str | Path) -> list[str]:
    """Problems of ``path`` as the native directory vLLM's ``method: eagle3`` reads (empty = valid)."""
    return validate_native(path, "vllm")


def validate_speculators(path: str | Path) -> list[str]:
    """Problems that keep ``path`` from being a valid speculators-format EAGLE-3 directory (empty = valid)."""
    path, problems = Path(path), _Problems()
    cfg = _open_config(path, problems)
    if cfg is None:
        return list(problems)
    _check_architecture(cfg, SPECULATORS_ARCHITECTURE, problems)
    if cfg.get("speculators_model_type") != "eagle3":
        problems.add(f"config: speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    if not isinstance(cfg.get("speculators_version"), str) or not cfg.get("speculators_version"):
        problems.add("config: missing required key 'speculators_version'")
    flags = dict(fc_norm=_get_bool(cfg, "fc_norm", "config", problems),
                 norm_before_fc=_get_bool(cfg, "norm_before_fc", "config", problems))
    # vLLM defaults a missing norm_before_residual to True, native drafts use False: it must be explicit.
    _get_bool(cfg, "norm_before_residual", "config", problems, required=True)
    _get_bool(cfg, "norm_output", "config", problems)
    _get_bool(cfg, "embed_requires_grad", "config", problems)
    if flags["fc_norm"] and flags["norm_before_fc"]:
        problems.add("config: fc_norm and norm_before_fc are mutually exclusive")

    dims = None
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        problems.add("config: missing required key 'transformer_layer_config' (an object)")
    else:
        if tl.get("model_type", "llama") != "llama":
            problems.add(f"config: transformer_layer_config.model_type is {tl.get('model_type')!r}, expected 'llama'")
        dims = _draft_dims(cfg, tl, "config: transformer_layer_config", flags, problems)
        _window_readable(tl, "config: transformer_layer_config", problems)
    _check_aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), "config: eagle_aux_hidden_state_layer_ids", problems)
    _speculators_block_problems(cfg.get("speculators_config"), problems)
    meta, small = _tensor_meta(path, problems)
    if meta:
        _check_tensors(meta, small, dims, speculators_layer_prefix, cfg.get("torch_dtype"), problems)
    return list(problems)


def _speculators_block_problems(sc: Any, problems: _Problems) -> None:
    where = "config: speculators_config"
    if not isinstance(sc, dict):
        problems.add(f"{where}: missing (an object with algorithm, proposal_methods, verifier)")
        return
    if sc.get("algorithm") != "eagle3":
        problems.add(f"{where}.algorithm is {sc.get('algorithm')!r}, expected 'eagle3'")
    methods = sc.get("proposal_methods")
    types = []
    if not isinstance(methods, list) or not methods:
        problems.add(f"{where}.proposal_methods must be a non-empty list")
    else:
        for j, m in enumerate(methods):
            if not isinstance(m, dict) or not m.get("proposal_type"):
                problems.add(f"{where}.proposal_methods[{j}] lacks proposal_type")
                continue
            types.append(m["proposal_type"])
            k = m.get("speculative_tokens")
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                problems.add(f"{where}.proposal_methods[{j}].speculative_tokens must be a positive integer, got {k!r}")
    if types and sc.get("default_proposal_method") not in types:
        problems.add(f"{where}.default_proposal_method {sc.get('default_proposal_method')!r} is not one of {types}")
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict) or "name_or_path" not in verifier:
        problems.add(f"{where}.verifier must be an object with name_or_path")
    elif not isinstance(verifier.get("architectures", []), list):
        problems.add(f"{where}.verifier.architectures must be a list")


def validate(path: str | Path, format: str) -> list[str]:
    """The validator of ``format``: ``sglang``, ``vllm``, ``speculators``, or ``native`` (the native variant the
    directory's draftlab block names)."""
    if format == "native":
        return validate_native(path)
    if format in _NATIVE_ENGINES:
        return validate_native(path, format)
    if format == "speculators":
        return validate_speculators(path)
    raise ValueError(f"unknown export format {format!r}; use one of {FORMATS}")


def check_valid(path: str | Path, format: str) -> None:
    """Raise ``ValueError`` listing every problem if ``path`` is not a valid ``format`` export."""
    problems = validate(path, format)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"{path} is not a valid {format} EAGLE-3 export ({len(problems)} problems):\n{lines}")


__all__ = ["FORMATS", "check_valid", "validate", "validate_native", "validate_sglang", "validate_speculators",
           "validate_vllm"]
