"""Where a draft model comes from: the target's first layers (no download, no training), or any causal LM
that shares the target's tokenizer."""

from __future__ import annotations

import copy

import torch

from draftlab.targets.hf import HFTarget


def truncated_model(target: HFTarget, layers: int) -> HFTarget:
    """The target's first ``layers`` decoder layers, its final norm and its LM head, as a model of its own.

    The modules are the target's (no weight is copied): the draft reads the same embedding and layers, and
    only its KV cache is separate. The embedded SmolLM2 has no smaller sibling; its first layers are the
    cheapest draft that needs neither a download nor training.
    """
    L = target.geometry.num_layers
    if not 1 <= int(layers) <= L:
        raise ValueError(f"draft layers must be in [1, {L}] for a {L}-layer target, got {layers}")
    src = target.model
    cfg = copy.deepcopy(src.config)
    cfg.num_hidden_layers = int(layers)
    if isinstance(getattr(cfg, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        cfg.layer_types = cfg.layer_types[: int(layers)]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # a shell: every module with weights is replaced by the target's below
        model = AutoModelForCausalLM.from_config(cfg)
    model.model.embed_tokens = src.model.embed_tokens
    model.model.layers = torch.nn.ModuleList(list(src.model.layers[: int(layers)]))
    model.model.norm = src.model.norm
    model.model.rotary_emb = src.model.rotary_emb
    model.lm_head = src.lm_head
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise NotImplementedError(f"cannot truncate a '{cfg.model_type}' model: {left[:3]} have no target weights")
    return HFTarget(model, target.tokenizer, name=f"{target.name}[:{layers}]", row_kernels="gemm",
                    compile=getattr(target, "compile_mode", "off"))


def check_same_tokenizer(draft: HFTarget, target: HFTarget, source: str) -> None:
    """``ValueError`` naming the difference unless the draft scores the target's vocabulary: the same
    vocabulary size and the same token for every id."""
    dv, tv = draft.geometry.vocab_size, target.geometry.vocab_size
    if dv != tv:
        raise ValueError(f"draft model '{source}' has a vocabulary of {dv} logits, the target '{target.name}' {tv}: "
                         "a draft model must share the target's tokenizer")
    dvocab, tvocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dvocab != tvocab:
        diff = sorted(set(dvocab.items()) ^ set(tvocab.items()))[:3]
        raise ValueError(f"draft model '{source}' and the target '{target.name}' tokenize differently "
                         f"(e.g. {diff}): a draft model must share the target's tokenizer")


def load_draft_model(source: str, target: HFTarget, layers: int | None) -> HFTarget:
    """``source == 'truncate'``: the target's first ``layers`` layers. Otherwise a causal LM (local directory,
    hub id, ``asset:<name>``), in the target's dtype and on its device, checked against its tokenizer. Either
    way the draft's passes take the target's ``compile`` setting (targets/compiled.py): the draft/verify cost
    ratio is then the compiled engine's on both sides."""
    if source == "truncate":
        if layers is None:
            raise ValueError("source 'truncate' needs drafter.layers (how many of the target's layers draft)")
        return truncated_model(target, int(layers))
    from draftlab.targets import load_target

    dtype = str(target.dtype).removeprefix("torch.")
    draft = load_target(source, dtype=dtype, device=str(target.device), compile=getattr(target, "compile_mode", "off"))
    check_same_tokenizer(draft, target, source)
    if layers is not None:
        draft = truncated_model(draft, int(layers))
    return draft
