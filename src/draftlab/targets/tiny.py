"""``tiny_random``: a 2-layer random Llama that shares the SmolLM2 tokenizer, for fast unit tests.

It has the embedded target's vocabulary and chat template (so data, templates and vocab maps behave as
with the real model) but hidden size 64, so a forward costs microseconds and tests stay fast. Weights
come from a seeded init, so two loads give identical models.

Any Llama shape can be asked for (``num_layers``, ``hidden_size``, ..., ``vocab_size``): SmolLM2-135M's, or
an 8B model's on ``meta`` to check shapes and devices without memory. ``tokenizer`` names a local directory
with the tokenizer files, for machines that cannot fetch the asset (a GPU node without network).
"""

from __future__ import annotations

import torch

from draftlab.targets.hf import HFTarget, resolve_dtype


def tiny_random_target(*, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                       intermediate_size: int = 128, vocab_size: int | None = None, initializer_range: float = 0.2,
                       seed: int = 0, dtype: str = "float32", device: str = "cpu",
                       tokenizer: str | None = None, tokenizer_asset: str = "smollm2-135m-instruct",
                       **kwargs) -> HFTarget:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer(tokenizer, tokenizer_asset)
    vocab = len(tok) if vocab_size is None else int(vocab_size)
    if vocab < len(tok):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tok)} tokens")
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # A larger init than HF's 0.02 gives peaked, input-dependent logits, so tests see real accept/reject.
    cfg.initializer_range = initializer_range
    if torch.device(device).type == "meta":  # shapes only: nothing to initialise, nothing to allocate
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(resolve_dtype(dtype))
        return HFTarget(model, tok, name="tiny_random", **kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(resolve_dtype(dtype))  # initialised on the CPU: the same weights anywhere
    return HFTarget(model.to(device), tok, name="tiny_random", **kwargs)


def _tokenizer(directory: str | None, asset: str):
    """The tokenizer in ``directory`` when given (no network needed), else the asset's (fetched once)."""
    from transformers import AutoTokenizer

    if directory is not None:
        return AutoTokenizer.from_pretrained(str(directory))
    from draftlab.assets import fetch

    return AutoTokenizer.from_pretrained(str(fetch(asset)))
