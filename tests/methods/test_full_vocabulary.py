"""DFlash-family drafts are full-vocabulary (no d2t / t2d mapping): they predict through the target's own LM head,
their exports carry no vocabulary map, and a reduced draft vocabulary is refused by name."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from draftlab.utils.errors import ConfigError
from tests.decoding.conformance.methods import untrained_draft


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_the_export_holds_no_vocabulary_map_and_the_targets_vocabulary(method, tiny_target, tmp_path):
    s, draft = untrained_draft(method, tiny_target)
    from hydra.utils import instantiate

    writer = next(w for w in s.cfg.export.formats.values() if w is not None)  # a successor drops DFlash's format
    out = instantiate(writer)(draft, tmp_path / method, target=tiny_target)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == tiny_target.geometry.vocab_size
    assert "draft_vocab_size" not in config or config["draft_vocab_size"] in (None, config["vocab_size"])
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if n.split(".")[-1] in ("d2t", "t2d")]
    # the logits are the target's LM head over the whole vocabulary
    assert draft.lm_head_weight.shape[0] == tiny_target.geometry.vocab_size


def test_a_reduced_draft_vocabulary_is_refused_by_name(tiny_target):
    import torch

    from draftlab.data.vocab import build_vocab_mapping

    s, _ = untrained_draft("dflash", tiny_target)
    vocab = build_vocab_mapping(torch.ones(tiny_target.geometry.vocab_size), 16)
    with pytest.raises(ConfigError, match="full vocabulary"):
        s.build_draft(tiny_target, vocab)
