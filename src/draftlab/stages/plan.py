"""A training plan: what a run of a composed config will build and store, from configs alone.

``training_plan(cfg)`` reads the target's model config (``draftlab.targets.config_facts``: no weights, no
tokenizer, no network under ``HF_HUB_OFFLINE``) and the method config, and gives the target's geometry, the
layers the draft taps, the resolved draft vocabulary, the draft's sizes and parameter count, the offline
feature storage per token and for the configured data, and the method's own training quantities. The draft's
part comes from the method's ``plan`` module beside its draft builder (``draftlab.methods.<m>.plan.plan``),
where it has one; the rest holds for every method.

    python -m draftlab.stages.plan target=llama3_8b method=eagle3 [--json] [other overrides]
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from draftlab.data.features import _row_width, store_dtype_name
from draftlab.methods.registry import MethodSpec, auto_draft_vocab_size
from draftlab.targets.config_facts import target_hf_config


def training_plan(cfg: DictConfig) -> dict[str, Any]:
    """The plan of ``cfg`` (a composed, prepared training config; left unchanged)."""
    cfg = copy.deepcopy(cfg)
    target = target_hf_config(cfg.target)
    g = target.geometry
    spec = MethodSpec(cfg.method)
    configured = spec.block("draft_vocab_size")
    spec.for_target(target)
    draft_vocab = spec.draft_vocab_size
    out: dict[str, Any] = {
        "target": {
            "source": target.name, "config_from": target.origin, "model_type": g.model_type,
            "num_layers": g.num_layers, "hidden_size": g.hidden_size, "num_heads": g.num_heads,
            "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim, "intermediate_size": g.intermediate_size,
            "vocab_size": g.vocab_size, "tie_word_embeddings": target.tie_word_embeddings,
            "dtype": str(target.dtype).removeprefix("torch."), "layer_convention": target.layer_convention.value,
        },
        "method": {"name": spec.name, "trainable": spec.trainable},
        "draft_vocab": {"configured": configured, "resolved": draft_vocab,
                        "auto_would_be": auto_draft_vocab_size(g.vocab_size)},
        "taps": spec.taps,
        "draft": None,
    }
    part = _method_part(spec, target, draft_vocab)
    if part is not None:
        out.update(part)
    # Without the method's part and its own taps setting, which layers the draft taps is the draft builder's
    # default: not known here, and neither is the feature row width.
    out["features"] = _features(spec, target, out["taps"], cfg)
    return out


def _method_part(spec: MethodSpec, target, draft_vocab: int | None) -> dict[str, Any] | None:
    """The method's own plan (``plan(target, draft_vocab_size=, taps=, draft=)`` in the ``plan`` module of the
    package whose builder makes its draft), or None where it has none."""
    draft = spec.block("draft")
    if not spec.trainable or draft is None or draft_vocab is None:
        return None
    builder = str(draft.get("_target_", ""))
    package = builder.rsplit(".", 2)[0] if builder.count(".") >= 2 else ""
    try:
        module = importlib.import_module(f"{package}.plan")
    except ImportError:
        return None
    fn = getattr(module, "plan", None)
    if fn is None:
        return None
    return fn(target, draft_vocab_size=draft_vocab, taps=spec.taps,
              draft=OmegaConf.to_container(draft, resolve=True))


def _features(spec: MethodSpec, target, taps: list[int] | None, cfg: DictConfig) -> dict[str, Any]:
    """The offline feature store's size: per token (the tapped states and the final one, as
    ``draftlab.data.features`` writes them) and at most for the configured data (samples x max_length)."""
    block = spec.block("features")
    if block is None:
        return {"offline": False}
    dtype = store_dtype_name(block.get("dtype", "auto"), target)
    per_value = getattr(torch, dtype).itemsize
    if taps is None:
        return {"offline": True, "dtype": dtype, "bytes_per_value": per_value, "row_width": None}
    width = _row_width(target, taps)
    samples, max_length = _data_bound(cfg)
    tokens = None if samples is None or max_length is None else samples * max_length
    return {"offline": True, "dtype": dtype, "bytes_per_value": per_value, "row_width": width,
            "bytes_per_token": width * per_value, "samples_at_most": samples, "max_length": max_length,
            "tokens_at_most": tokens, "bytes_at_most": None if tokens is None else tokens * width * per_value}


def _data_bound(cfg: DictConfig) -> tuple[int | None, int | None]:
    """(conversations the data config takes at most: the sum of its sources' limits, its max_length); None
    where a source has no limit."""
    data = cfg.get("data")
    if data is None:
        return None, None
    max_length = data.get("max_length")
    total = 0
    for source in (data.get("sources") or {}).values():
        if source is None:
            continue
        if source.get("limit") is None:
            total = None
            break
        total += int(source.limit)
    return total, None if max_length is None else int(max_length)


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as aligned ``key: value`` lines, one section per block."""
    lines: list[str] = []

    def emit(key: str, value: Any, indent: int) -> None:
        pad = "  " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            for k, v in value.items():
                emit(str(k), v, indent + 1)
        else:
            lines.append(f"{pad}{key}: {_fmt(key, value)}")

    for key, value in plan.items():
        emit(key, value, 0)
    return "\n".join(lines)


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)
    text = f"{value:,}"
    if key.startswith("bytes") and value >= 2**20:
        text += f" ({value / 2**30:.2f} GiB)" if value >= 2**30 else f" ({value / 2**20:.1f} MiB)"
    elif key in ("total", "trainable", "frozen_embedding", "lm_head") and value >= 10**6:
        text += f" ({value / 1e6:.1f} M)"
    return text


def main(argv: list[str] | None = None) -> None:
    """``python -m draftlab.stages.plan [--json] [overrides...]``: the plan of ``conf/train.yaml`` with them."""
    from draftlab.configs import compose_train_config

    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    plan = training_plan(compose_train_config(args))
    print(json.dumps(plan, indent=2) if as_json else format_plan(plan))


if __name__ == "__main__":
    main()
