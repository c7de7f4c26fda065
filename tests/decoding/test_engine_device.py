"""Everything the engine creates lives on the target's device (checked on CPU by recording what it asks for)."""

from __future__ import annotations

import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.prompt_lookup import PromptLookupDrafter


def test_the_engines_generator_is_made_on_the_targets_device(tiny_target, monkeypatch):
    # A CPU generator with CUDA logits is refused by torch.rand / torch.multinomial, so every evaluation at
    # T > 0 would crash on a GPU: the device must be asked for explicitly, and be the target's.
    asked, real = [], torch.Generator

    def recording(*args, **kwargs):
        asked.append(kwargs.get("device", args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", recording)
    cfg = GenerationConfig(max_new_tokens=4, temperature=0.7, seed=0, stop_on_eos=False)
    speculative_generate(tiny_target, [5, 6, 7, 5, 6], PromptLookupDrafter(nodes=2), cfg)
    autoregressive_generate(tiny_target, [5, 6, 7], cfg)
    assert len(asked) == 2 and all(d is not None and torch.device(d) == tiny_target.device for d in asked), asked
