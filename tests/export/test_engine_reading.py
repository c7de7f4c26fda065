"""Every export, read with its engine's own rules (``engine_readers``), drafts what draftlab's drafter drafts.

The target is a 6-layer random Llama so that neighbouring layers' hidden states differ and an id read one layer
off shows; the draft taps output_of [1, 2, 3] (vLLM / speculators: input_to [2, 3, 4]). Runs on CPU in
about a second.
"""

from __future__ import annotations

import pytest
import torch
from engine_readers import (
    READERS,
    EngineWouldMisread,
    drafter_chain_tokens,
    draftlab_chain,
    engine_chain,
    read_sglang,
    read_vllm,
)

from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.eagle3 import Eagle3Draft
from draftlab.methods.eagle3.export import export_checkpoint, save_native, save_speculators, save_vllm
from draftlab.targets.tiny import tiny_random_target

STEPS = 3
TAPS = [1, 2, 3]  # output_of
ATOL = 1e-5


@pytest.fixture(scope="module")
def deep_target():
    # Double precision keeps HF's layer code and draftlab's within 1e-12 of each other, so ATOL only has to
    # absorb rounding; a layer read one off changes the logits by O(1).
    return tiny_random_target(num_layers=6, dtype=torch.float64)


@pytest.fixture(scope="module")
def prompt(deep_target):
    return deep_target.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]


def make_draft(target, seed: int = 0, **kw) -> Eagle3Draft:
    """A random draft for ``target`` with non-trivial norms (so every norm rule changes the output)."""
    torch.manual_seed(seed)
    kw.setdefault("aux_layer_ids", list(TAPS))
    g = target.geometry
    freq = torch.randint(0, 1000, (g.vocab_size,), generator=torch.Generator().manual_seed(seed))
    draft = Eagle3Draft.from_target(target, vocab_mapping=build_vocab_mapping(freq, 256), **kw)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return draft.double().eval()


def assert_reads_as_trained(reader, draft, target, prompt) -> None:
    want_logits, want_tokens = draftlab_chain(draft, target, prompt, STEPS)
    got_logits, got_tokens = engine_chain(reader, target, prompt, STEPS)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=0)
    assert got_tokens == want_tokens


SAVERS = {"sglang": save_native, "vllm": save_vllm, "speculators": save_speculators}
# What each engine builds: SGLang's EAGLE-3 model has no norm switches and no extra-layer norms draftlab writes.
VARIANTS = {
    "sglang": {"default": {}, "input_to_taps": {"aux_layer_ids": [2, 3, 4], "layer_convention": "input_to"}},
    "vllm": {"default": {}, "input_to_taps": {"aux_layer_ids": [2, 3, 4], "layer_convention": "input_to"},
             "fc_norm": {"fc_norm": True}, "norm_before_fc": {"norm_before_fc": True},
             "norm_before_residual": {"norm_before_residual": True}, "two_layers": {"num_layers": 2}},
}
# vLLM's model code again; only the layer names and the missing-key defaults differ.
VARIANTS["speculators"] = {k: VARIANTS["vllm"][k] for k in ("default", "norm_before_residual", "two_layers")}


def test_the_harness_is_draftlabs_drafter(deep_target, prompt):
    """``draftlab_chain`` proposes exactly what ``Eagle3Drafter`` proposes in ``speculative_generate``."""
    draft = make_draft(deep_target)
    _, tokens = draftlab_chain(draft, deep_target, prompt, STEPS)
    assert drafter_chain_tokens(draft, deep_target, prompt, STEPS) == tokens


@pytest.mark.parametrize("fmt,variant", [(f, v) for f in SAVERS for v in VARIANTS[f]])
def test_each_format_is_read_by_its_engine_as_trained(tmp_path, deep_target, prompt, fmt, variant):
    draft = make_draft(deep_target, **VARIANTS[fmt][variant])
    out = SAVERS[fmt](draft, tmp_path, verifier=deep_target)
    assert_reads_as_trained(READERS[fmt](out, deep_target), draft, deep_target, prompt)
    if fmt == "sglang":
        # Newer SGLang model files add one only when the first id is 1: the same reading for these ids.
        assert_reads_as_trained(read_sglang(out, deep_target, first_id_rule=True), draft, deep_target, prompt)


def test_export_all_writes_what_each_engine_reads(tmp_path, deep_target, prompt):
    """``draftlab-export format=all``'s directories, each read by its engine (fails before the per-engine
    variants: vLLM read the SGLang directory's output_of ids as input_to and norm_output as post-norm feedback)."""
    draft = make_draft(deep_target)
    src = save_native(draft, tmp_path / "src")
    written = export_checkpoint(src, tmp_path / "out", format="all", target=deep_target)
    assert set(written) == {"sglang", "vllm", "speculators"}
    for fmt, path in written.items():
        assert_reads_as_trained(READERS[fmt](path, deep_target), draft, deep_target, prompt)


def test_vllm_misreads_the_sglang_directory(tmp_path, deep_target, prompt):
    """The review's finding, kept as a guard: vLLM on the SGLang directory feeds other layers (the output_of ids
    as input_to, or, in builds that read only the top-level key, its default taps) and the post-norm state back;
    only the vllm variant reads as trained."""
    draft = make_draft(deep_target)
    out = save_native(draft, tmp_path)
    want, _ = draftlab_chain(draft, deep_target, prompt, STEPS)
    for fallback in (True, False):
        reader = read_vllm(out, deep_target, eagle_config_fallback=fallback)
        assert reader.capture != [2, 3, 4] and reader.feed_post_norm
        got, _ = engine_chain(reader, deep_target, prompt, STEPS)
        assert not torch.allclose(got, want, atol=1e-3)


def test_engines_that_would_ignore_a_switch_are_named(tmp_path, deep_target):
    """SGLang builds no fc_norm / input_norm modules: reading such an export is refused, not silently wrong."""
    for kw in ({"fc_norm": True}, {"norm_before_fc": True}, {"num_layers": 2}):
        out = save_native(make_draft(deep_target, **kw), tmp_path / str(kw))
        with pytest.raises(EngineWouldMisread):
            read_sglang(out, deep_target)
