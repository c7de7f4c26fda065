"""``tiny_random``: a 2-layer random Llama that shares the SmolLM2 tokenizer, for fast unit tests.

It has the embedded target's vocabulary and chat template (so data, templates and vocab maps behave as
with the real model) but hidden size 64, so a forward costs microseconds and tests stay fast. Weights
come from a seeded init, so two loads give identical models.
"""

from __future__ import annotations

import torch

from draftlab.targets.hf import HFTarget, resolve_dtype


def tiny_random_target(*, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                       intermediate_size: int = 128, seed: int = 0, dtype: str = "float32", device: str = "cpu",
                       tokenizer_asset: str = "smollm2-135m-instruct", **kwargs) -> HFTarget:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftlab.assets import fetch

    tok = AutoTokenizer.from_pretrained(str(fetch(tokenizer_asset)))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # A larger init than HF's 0.02 gives peaked, input-dependent logits, so tests see real accept/reject.
    cfg.initializer_range = 0.2
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(resolve_dtype(dtype))  # initialised on the CPU: the same weights anywhere
    return HFTarget(model.to(device), tok, name="tiny_random", **kwargs)
