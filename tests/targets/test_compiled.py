"""Compiled decode and verify passes (``targets/compiled.py``, ``engine.compile``): the same logits, cache
rows and tokens as the eager forward, one graph per row bucket for every sequence, and every pass the
graphs do not cover run eagerly and counted.

These tests compile: a few seconds per row bucket on the tiny target, paid once per worker (the session's
``compiled_tiny_target``, shared with the conformance suite's compiled check); that is why there are few.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets.base import PassRequest
from draftlab.targets.cache import PinnedKV
from draftlab.targets.compiled import (
    AUTO_MIN_WEIGHT_BYTES,
    ROW_BUCKETS,
    bucket,
    resolve_mode,
    row_product,
    weight_major_product,
)
from draftlab.targets.packed_linear import available as packed_available
from draftlab.targets.packed_linear import packed_linear

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
        spec, stats = speculative_generate(compiled_tiny, prompt, PromptLookupDrafter(nodes=3), cfg)
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


@pytest.mark.skipif(not packed_available(torch.bfloat16), reason="oneDNN bf16 linear needs AVX512-BF16/AMX")
def test_the_packed_product_is_linear_and_follows_in_place_writes():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x, w, b = torch.randn(1, 5, 64, dtype=dtype), torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(packed_linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=tol, atol=tol)
        w.mul_(-2)  # the reordered copy is stale now: the product must follow the weight, not the copy
        torch.testing.assert_close(packed_linear(x, w), torch.nn.functional.linear(x, w), rtol=tol, atol=tol)


@pytest.mark.skipif(not packed_available(torch.bfloat16), reason="oneDNN bf16 linear needs AVX512-BF16/AMX")
def test_a_bf16_compiled_verify_pass_is_as_close_to_fp32_as_the_eager_one():
    """bf16 passes of 2+ rows go through oneDNN's reordered weights (``packed_linear``), another summation order
    than the eager pass: measured against the fp32 pass, the compiled bf16 logits must be as close as the eager
    bf16 ones (the same rounding, not more) and pick the fp32 argmax wherever it is clear."""
    from draftlab.targets import load_target

    k, tree = 6, _tree(6)  # bucket 8: one graph compiles
    logits = {}
    for dtype, mode in (("float32", "off"), ("bfloat16", "off"), ("bfloat16", "on")):
        target = load_target("tiny_random", dtype=dtype, compile=mode)
        cache = _context(target)
        mask = torch.cat([torch.ones(k, cache.length, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
        with torch.no_grad():
            logits[dtype, mode] = target.forward(tree.tokens[None], cache.length + tree.depth, cache,
                                                 mask).logits.float()
    assert target.compile_stats()["compiled_passes"] == 1
    ref = logits["float32", "off"]
    err = {m: (logits["bfloat16", m] - ref).abs() for m in ("off", "on")}
    assert err["on"].mean() <= 1.25 * err["off"].mean() and err["on"].max() <= 1.5 * err["off"].max()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * err["off"].amax(-1)  # rows bf16 rounding cannot flip
    assert clear.any()
    assert torch.equal(logits["bfloat16", "on"].argmax(-1)[clear], ref.argmax(-1)[clear])


def test_auto_leaves_the_test_target_eager_and_config_reaches_the_target():
    from hydra.utils import instantiate

    from draftlab.configs import compose_train_config

    cfg = compose_train_config(["target=tiny_random"])
    assert cfg.engine.compile == "auto" and cfg.target.compile == "auto"
    target = instantiate(cfg.target)
    assert target.compile_mode == "auto" and not target.compiled  # 13 MB of weights: compiling never pays
    on = instantiate(compose_train_config(["target=tiny_random", "engine.compile=on"]).target)
    assert on.compiled
