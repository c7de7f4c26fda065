"""A draft built for another target geometry is refused from its config, before any weight is read, with the
file and the field that disagree (the CLI prints it as one line)."""

from __future__ import annotations

import pytest

from draftlab.methods.eagle3 import Eagle3Draft
from draftlab.methods.eagle3.export import convert, native
from draftlab.methods.eagle3.export.convert import load_draft
from draftlab.methods.eagle3.export.native import save_native
from draftlab.methods.eagle3.export.speculators import save_speculators
from draftlab.targets.tiny import tiny_random_target
from draftlab.utils.errors import ArtifactError


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_a_draft_for_another_hidden_size_is_refused_by_its_config(tmp_path, fmt, monkeypatch):
    other = tiny_random_target(hidden_size=48, num_heads=4, num_kv_heads=2)
    draft = Eagle3Draft.from_target(other, draft_vocab_size=64, aux_layer_ids=[0, 0, 1])
    out = tmp_path / fmt
    if fmt == "native":
        save_native(draft, out, verifier=other)
    else:
        save_speculators(draft, out, include_embedding=True)
    assert load_draft(out, target=other).config.hidden_size == 48  # fits its own target

    def no_weights(*a, **k):
        raise AssertionError("weights were read before the geometry check")

    monkeypatch.setattr(native, "read_tensors", no_weights)
    monkeypatch.setattr(convert, "load_speculators", no_weights)
    monkeypatch.setattr(convert, "load_native", no_weights)
    target = tiny_random_target()  # hidden size 64
    with pytest.raises(ArtifactError) as err:
        load_draft(out, target=target)
    e = err.value
    assert e.file == str(out / "config.json")
    assert e.field == ("hidden_size" if fmt == "native" else "transformer_layer_config.hidden_size")
    assert "48" in str(e) and "64" in str(e) and str(e).startswith(str(out / "config.json"))


def test_a_lightning_checkpoint_for_another_target_is_refused_before_its_weights(tmp_path, monkeypatch):
    from draftlab.methods.eagle3.export import lightning as lightning_ckpt
    from tests.export.test_export_cli import write_lightning_checkpoint

    other = tiny_random_target(hidden_size=48, num_heads=4, num_kv_heads=2)
    ckpt = write_lightning_checkpoint(Eagle3Draft.from_target(other, draft_vocab_size=64, aux_layer_ids=[0, 0, 1]),
                                      tmp_path / "other.ckpt")
    assert load_draft(ckpt, target=other).config.hidden_size == 48  # fits its own target

    real_load = lightning_ckpt.torch.load

    def config_only(*a, **k):
        # The check may map the file (mmap: tensors stay on disk), never read it whole.
        if not k.get("mmap"):
            raise AssertionError("weights were read before the geometry check")
        return real_load(*a, **k)

    monkeypatch.setattr(lightning_ckpt.torch, "load", config_only)
    with pytest.raises(ArtifactError) as err:
        load_draft(ckpt, target=tiny_random_target())
    e = err.value
    assert e.file == str(ckpt) and e.field == "eagle3_config.hidden_size"
    assert "48" in str(e) and "64" in str(e)
