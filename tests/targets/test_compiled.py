"""Compiled decode and verify passes (``targets/compiled.py``, ``engine.compile``): the same logits, cache
rows and tokens as the eager forward, one graph per row bucket for every sequence, and every pass the
graphs do not cover run eagerly and counted.

These tests compile: a few seconds per row bucket on the tiny target, paid once per worker (the session's
``compiled_tiny_target``, shared with the conformance suite's compiled check); that is why there are few.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.cache import PinnedKV
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets.base import PassRequest
from draftlab.targets.compiled import (
    AUTO_MIN_WEIGHT_BYTES,
    ROW_BUCKETS,
    bucket,
    resolve_mode,
    row_product,
    weight_major_product,
)

pytestmark = pytest.mark.xdist_group("compiled-tiny")


@pytest.fixture
def compiled_tiny(compiled_tiny_target):
    return compiled_tiny_target


def _context(target, n: int = 24):
    cache = target.new_cache(1, n + 80)
    target.forward(torch.arange(100, 100 + n)[None], cache=cache)
    cache.commit(n)
    return cache


def _tree(k: int) -> DraftTree:
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)])
    return DraftTree.from_parents(torch.arange(k) * 37 % 4000 + 7, parents)


@pytest.mark.parametrize("k", [1, 3, 6])  # buckets 1, 4, 8: pad rows in the last two
def test_a_compiled_verify_pass_computes_what_the_eager_one_does(tiny_target, compiled_tiny, k):
    tree = _tree(k)
    outs, caches = [], []
    for target in (tiny_target, compiled_tiny):
        cache = _context(target)
        mask = torch.cat([torch.ones(k, cache.length, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
        out = target.forward(tree.tokens[None], cache.length + tree.depth, cache, mask,
                             PassRequest(aux=True, last_hidden=True))
        outs.append(out)
        caches.append(cache)
    eager, compiled = outs
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.aux_hidden, eager.aux_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.last_hidden, eager.last_hidden, rtol=1e-4, atol=1e-4)
    n = caches[0].length
    # The committed context and the pass's own rows hold the same K/V (pad rows only touch scratch after them).
    torch.testing.assert_close(caches[1].k[:, :, :, :n + k], caches[0].k[:, :, :, :n + k], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].v[:, :, :, :n + k], caches[0].v[:, :, :, :n + k], rtol=1e-4, atol=1e-4)
    assert compiled_tiny.compile_stats()["compiled_passes"] > 0


def test_compiled_decoding_equals_eager_and_ar_without_recompiling(tiny_target, compiled_tiny):
    from draftlab.methods.prompt_lookup import PromptLookupDrafter

    cfg = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    prompts = [list(range(200, 230)), [5, 9, 11, 5, 9, 11, 5, 9], list(range(300, 371))]  # three cache lengths
    for prompt in prompts:
        ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
        ar, _ = autoregressive_generate(compiled_tiny, prompt, cfg)
        spec, stats = speculative_generate(compiled_tiny, prompt, PromptLookupDrafter(num_draft_tokens=3), cfg)
        assert ar == ref and spec == ref
    stats = compiled_tiny.compile_stats()
    assert stats["recompiles"] == 0, stats  # every sequence, every step: one graph per bucket
    assert all(n == 1 for n in stats["graphs_per_bucket"].values()), stats
    assert stats["compiled"] and stats["compile"] == "on"


def test_passes_the_graphs_do_not_cover_run_eager_and_are_counted(tiny_target, compiled_tiny):
    before = compiled_tiny.compile_stats()
    outs = []
    for target in (tiny_target, compiled_tiny):
        cache = _context(target)  # a prefill: eager
        pinned_cache = target.new_cache(1, 4)
        target.forward(torch.tensor([[3, 4, 5]]), cache=pinned_cache)
        pinned_cache.commit(3)
        req = PassRequest(pinned=PinnedKV.capture(pinned_cache), attn_mass_rows=1)
        outs.append(target.forward(torch.tensor([[8, 9]]), None, cache, None, req))
        outs.append(target.forward(torch.full((1, 70), 12), None, _context(target)))  # past the last bucket
    after = compiled_tiny.compile_stats()
    assert after["eager_passes"] - before["eager_passes"] == 5  # three prefills, pinned + mass, 70 rows
    assert after["compiled_passes"] == before["compiled_passes"]
    torch.testing.assert_close(outs[2].logits, outs[0].logits, rtol=0, atol=0)
    torch.testing.assert_close(outs[3].logits, outs[1].logits, rtol=0, atol=0)


def test_buckets_and_modes():
    assert [bucket(r) for r in (1, 2, 3, 5, 33, 64, 65)] == [1, 2, 4, 8, 64, 64, None]
    assert ROW_BUCKETS[0] == 1
    cpu = torch.device("cpu")
    assert resolve_mode("auto", device=cpu, weight_bytes=AUTO_MIN_WEIGHT_BYTES, supported=True)
    assert not resolve_mode("auto", device=cpu, weight_bytes=AUTO_MIN_WEIGHT_BYTES - 1, supported=True)
    assert resolve_mode("on", device=cpu, weight_bytes=1, supported=True)
    assert not resolve_mode("on", device=cpu, weight_bytes=1, supported=False)
    assert not resolve_mode("off", device=cpu, weight_bytes=2**40, supported=True)
    with pytest.raises(ValueError, match="compile must be one of"):
        resolve_mode("always", device=cpu, weight_bytes=1, supported=True)


def test_the_products_are_linear():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(row_product(x, w, b), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_major_product(x, w, b), ref, rtol=1e-5, atol=1e-5)


def test_auto_leaves_the_test_target_eager_and_config_reaches_the_target():
    from hydra.utils import instantiate

    from draftlab.configs import compose_train_config

    cfg = compose_train_config(["target=tiny_random"])
    assert cfg.engine.compile == "auto" and cfg.target.compile == "auto"
    target = instantiate(cfg.target)
    assert target.compile_mode == "auto" and not target.compiled  # 13 MB of weights: compiling never pays
    on = instantiate(compose_train_config(["target=tiny_random", "engine.compile=on"]).target)
    assert on.compiled
