"""The engine on real transformer targets: tree-verify numerics and greedy losslessness."""

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.reference_drafters import OracleDrafter
from draftlab.decoding.tree import DraftTree, ancestor_mask, root_to_leaf_paths
from draftlab.methods.prompt_lookup import PromptLookupDrafter


def _tree_vs_paths(target, prompt, tree, atol):
    """Logits of a tree verify pass equal running every root-to-leaf path on its own."""
    cache = target.new_cache(1, 256)
    target.forward(torch.tensor([prompt]), cache=cache)
    cache.commit(len(prompt))
    past = cache.length
    mask = torch.cat([torch.ones(tree.size, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
    got = target.forward(tree.tokens[None], past + tree.depth, cache, mask).logits[0]  # [N, V]
    for path in root_to_leaf_paths(tree.parents):
        ref = target.forward(torch.tensor([prompt + tree.tokens[path].tolist()])).logits[0, len(prompt):]
        torch.testing.assert_close(got[path], ref, rtol=0, atol=atol)


def _random_tree(vocab, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree.from_parents(torch.randint(0, vocab, (n,), generator=g), torch.tensor(parents))


def test_tree_verify_logits_equal_sequential_paths_tiny(tiny_target):
    _tree_vs_paths(tiny_target, list(range(100, 117)), _random_tree(5000), atol=1e-4)


@pytest.mark.slow
def test_tree_verify_logits_equal_sequential_paths_smollm2(smollm2):
    _tree_vs_paths(smollm2, smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"],
                   _random_tree(20000, n=16, seed=1), atol=1e-4)


def test_commit_rows_keeps_the_accepted_path(tiny_target):
    """After committing a tree path, continuing equals having fed that path in the first place."""
    prompt = list(range(200, 210))
    tree = _random_tree(5000, n=10, seed=3)
    path = root_to_leaf_paths(tree.parents)[-1]
    cache = tiny_target.new_cache(1, 128)
    tiny_target.forward(torch.tensor([prompt]), cache=cache)
    cache.commit(len(prompt))
    past = cache.length
    mask = torch.cat([torch.ones(tree.size, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
    tiny_target.forward(tree.tokens[None], past + tree.depth, cache, mask)
    cache.commit_rows(path)
    nxt = tiny_target.forward(torch.tensor([[7]]), cache=cache).logits[0, -1]
    ref = tiny_target.forward(torch.tensor([prompt + tree.tokens[path].tolist() + [7]])).logits[0, -1]
    torch.testing.assert_close(nxt, ref, rtol=1e-5, atol=1e-4)


def test_engine_without_drafter_equals_ar(tiny_target):
    from draftlab.decoding.drafter import NoDrafter

    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    prompt = list(range(300, 320))
    a, _ = autoregressive_generate(tiny_target, prompt, cfg)
    b, stats = speculative_generate(tiny_target, prompt, NoDrafter(), cfg)
    assert a == b and stats.tau == 1.0


@pytest.mark.parametrize("branches", [3])  # the shipped config (one branch) is in tests/decoding/conformance
def test_prompt_lookup_is_lossless_tiny(tiny_target, branches):
    cfg = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = [5, 6, 7, 8, 9] * 6
    ar, _ = autoregressive_generate(tiny_target, prompt, cfg)
    out, stats = speculative_generate(tiny_target, prompt, PromptLookupDrafter(6, num_branches=branches), cfg)
    assert out == ar
    assert sum(stats.accept_lengths) + 1 == len(out)


def test_oracle_accepts_everything_tiny(tiny_target):
    cfg = GenerationConfig(max_new_tokens=31, stop_on_eos=False)
    prompt = list(range(40, 60))
    ar, _ = autoregressive_generate(tiny_target, prompt, cfg)
    out, stats = speculative_generate(tiny_target, prompt, OracleDrafter(depth=5), cfg)
    assert out == ar
    assert stats.accept_lengths == [6] * 5  # 1 from prefill + 5 rounds x (5 drafts + bonus)


def _specbench_prompts(shared_data, tokenizer, n):
    from draftlab.data.benchmarks import load_question_jsonl

    qs = load_question_jsonl(shared_data / "spec_bench" / "question.jsonl")
    by_cat: dict[str, list] = {}
    for q in qs:
        by_cat.setdefault(q.category, []).append(q)
    picked = []
    while len(picked) < n:  # round-robin over categories: every kind of prompt is covered
        for cat in sorted(by_cat):
            if by_cat[cat] and len(picked) < n:
                picked.append(by_cat[cat].pop(0))
    prompts = []
    for q in picked:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}], tokenize=False,
                                             add_generation_prompt=True)
        # The last 512 tokens keep each prompt's task and most of its text; prefill is not what is tested.
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][-512:])
    return prompts


# Spec-Bench prompts by index in the category round-robin of ``_specbench_prompts``, each there for a path of
# the engine on the real target (measured: PLD with 5 draft tokens, 48 new tokens):
SPECBENCH_PATHS = {
    1: "extraction: lookups accepted whole, several rounds in a row (accept length 6)",
    0: "coding: lookups partly accepted (accept lengths 2-5) between rounds where lookup finds nothing",
    6: "rag, cut to 512 tokens: a long context (rotary positions past 512) with accepted lookups",
}


@pytest.mark.slow
def test_greedy_speculative_equals_ar_on_specbench_smollm2(smollm2, shared_data):
    """Spec-Bench prompts x 48 new tokens: prompt lookup and oracle reproduce AR token for token, and between
    them the rounds take every path: a whole draft accepted, a draft cut part-way, no draft at all, the
    oracle's full rounds and its budget-cut last round."""
    cfg = GenerationConfig(max_new_tokens=48, stop_on_eos=False)
    everything = _specbench_prompts(shared_data, smollm2.tokenizer, max(SPECBENCH_PATHS) + 1)
    accepts, sizes = [], []
    for i in SPECBENCH_PATHS:
        prompt = everything[i]
        ar, _ = autoregressive_generate(smollm2, prompt, cfg)
        pld, stats = speculative_generate(smollm2, prompt, PromptLookupDrafter(nodes=5), cfg)
        assert pld == ar, SPECBENCH_PATHS[i]
        accepts += stats.accept_lengths
        sizes += stats.tree_sizes
        oracle, ostats = speculative_generate(smollm2, prompt, OracleDrafter(depth=4, reference=ar), cfg)
        assert oracle == ar
        # every round but possibly the budget-truncated last one accepts depth + bonus
        assert all(a == 5 for a in ostats.accept_lengths[:-1]) and ostats.accept_lengths[-1] <= 5
    assert 6 in accepts, "no lookup was accepted whole"
    assert any(1 < a < 6 for a in accepts), "no lookup was cut part-way"
    assert 1 in sizes, "every round found a lookup: the no-draft round was not exercised"


# EAGLE-3 (trained) on Spec-Bench x SmolLM2: tests/decoding/conformance (slow, every method config).
