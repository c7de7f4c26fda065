"""Tiny EAGLE-3 drafts for the export tests (d=64, 4/2 heads of 16, V=512, V_d=128)."""

from __future__ import annotations

import torch

from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.eagle3 import Eagle3Config, Eagle3Draft

D, FF, H, HKV, HD, V, VD = 64, 96, 4, 2, 16, 512, 128
AUX = [1, 5, 9]  # output_of


def tiny_config(**kw) -> Eagle3Config:
    base = dict(hidden_size=D, intermediate_size=FF, num_heads=H, num_kv_heads=HKV, head_dim=HD, vocab_size=V,
                draft_vocab_size=VD, aux_layer_ids=list(AUX))
    base.update(kw)
    return Eagle3Config(**base)


def tiny_draft(seed: int = 0, **kw) -> Eagle3Draft:
    """A draft with random weights, non-trivial norm weights and a random but valid vocab mapping."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(tiny_config(**kw))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # so that every norm switch changes the output
        draft.embed_tokens.weight.normal_()
    c = draft.config
    freq = torch.randint(0, 1000, (c.vocab_size,), generator=torch.Generator().manual_seed(seed))
    draft.set_vocab_mapping(build_vocab_mapping(freq, c.draft_vocab_size))
    return draft


def draft_outputs(draft: Eagle3Draft, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Two chained draft steps on random input: target features first, then the fed-back state."""
    c = draft.config
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 7
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)  # [B, T]
    aux = torch.randn(B, T, 3 * c.target_hidden_size, generator=g).to(draft.fc.weight.dtype)  # [B, T, 3*d_t]
    pos = torch.arange(T).expand(B, T)  # [B, T]
    with torch.no_grad():
        h1, logits1 = draft.forward_step(ids, aux, pos)  # [B, T, d], [B, T, V_d]
        h2, logits2 = draft.forward_step(ids.roll(1, 1), h1, pos + 1)
    return h1, logits1, h2, logits2


def edit_config(path, fn) -> None:
    """Rewrite ``path/config.json`` through ``fn(dict)`` (which edits in place)."""
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    fn(cfg)
    file.write_text(json.dumps(cfg))


def edit_tensors(path, fn) -> None:
    """Rewrite ``path/model.safetensors`` through ``fn(dict) -> dict``."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    save_file(fn(load_file(str(file))), str(file))
