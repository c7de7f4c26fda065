"""The cheap EAGLE-3 draft step: top-k in the draft vocabulary, vectorised tree bookkeeping, a bf16 draft.

- the draft-vocabulary top-k grows exactly the trees of the full-vocabulary reference path
  (``Eagle3Drafter(full_vocab=True)``), round by round on the same draft cache;
- ``build_dynamic_tree`` (vectorised) builds the trees the per-candidate reference below built, from
  full log-probs or from ``TopCandidates``, ties and impossible tokens included;
- ``dtype="bfloat16"`` / ``head_dtype="bfloat16"`` run the draft (its LM head) in a cast copy and stay
  lossless (greedy == AR, sampling valid); ``DraftLinear``'s bf16 kernels compute what ``F.linear`` does.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.dynamic_tree import FrontierBatch, TopCandidates, _best_first, build_dynamic_tree
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.tree import DraftTree
from draftlab.methods.eagle3 import Eagle3Draft, Eagle3Drafter
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT, greedy
from tests.methods.test_eagle3_drafter import trained  # noqa: F401  (the module-scoped trained draft)

# ---- 1. draft-vocabulary top-k == full-vocabulary top-k, on the same draft cache ------------------------


class _BothPaths(Eagle3Drafter):
    """Grows every round's tree twice on the same draft state: the reference path, then the fast one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pairs: list[tuple[DraftTree, DraftTree]] = []

    def propose(self, state):
        self.full_vocab = True
        try:
            ref = super().propose(state)
        finally:
            self.full_vocab = False
        fast = super().propose(state)
        self.pairs.append((ref, fast))
        return fast


def _same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            and torch.equal(a.depth, b.depth) and a.deterministic and b.deterministic)


@torch.no_grad()
@pytest.mark.parametrize(("branching", "depth", "nodes"), [(3, 3, 6), (4, 4, 16), (10, 5, 60)])
def test_draft_vocab_topk_grows_the_full_vocab_trees(tiny_target, trained, branching, depth, nodes):  # noqa: F811
    for prompt in (TRAIN_PROMPTS[0], UNSEEN_PROMPT):
        drafter = _BothPaths(trained.draft, branching=branching, depth=depth, nodes=nodes)
        out, stats = speculative_generate(tiny_target, prompt, drafter,
                                          GenerationConfig(max_new_tokens=24, temperature=0, stop_on_eos=False))
        assert out == greedy(tiny_target, prompt, 24)
        assert len(drafter.pairs) == stats.rounds >= 3
        for ref, fast in drafter.pairs:
            assert _same_tree(ref, fast), (ref.tokens.tolist(), fast.tokens.tolist())
        assert max(t.size for _, t in drafter.pairs) == nodes + 1


@torch.no_grad()
@pytest.mark.parametrize("kw", [{"dtype": "bfloat16"}, {"head_dtype": "bfloat16"}])
def test_draft_vocab_topk_grows_the_full_vocab_trees_in_bf16(tiny_target, trained, kw):  # noqa: F811
    drafter = _BothPaths(trained.draft, branching=4, depth=4, nodes=16, **kw)
    out, _ = speculative_generate(tiny_target, UNSEEN_PROMPT, drafter,
                                  GenerationConfig(max_new_tokens=16, temperature=0, stop_on_eos=False))
    assert out == greedy(tiny_target, UNSEEN_PROMPT, 16)
    assert drafter.pairs and all(_same_tree(ref, fast) for ref, fast in drafter.pairs)


@torch.no_grad()
def test_reference_path_decodes_the_same_trees_end_to_end(tiny_target, trained):  # noqa: F811
    """Two drafters, each on its own path throughout (its own appended rows too): same trees, same output."""
    trees = {}
    for full_vocab in (False, True):
        drafter = Eagle3Drafter(trained.draft, branching=4, depth=4, nodes=16, full_vocab=full_vocab)
        seen = []
        propose = drafter.propose
        drafter.propose = lambda state, seen=seen, propose=propose: seen.append(propose(state)) or seen[-1]
        out, _ = speculative_generate(tiny_target, TRAIN_PROMPTS[1], drafter,
                                      GenerationConfig(max_new_tokens=20, temperature=0, stop_on_eos=False))
        trees[full_vocab] = (out, seen)
    (out_a, a), (out_b, b) = trees[False], trees[True]
    assert out_a == out_b and len(a) == len(b)
    # Appended rows' heads differ only in which rows run (1 vs all): log-probs agree to rounding.
    assert all(_same_tree(x, y) for x, y in zip(a, b))


@torch.no_grad()
def test_a_vocabulary_smaller_than_top_k(tiny_target):
    """V_d < branching: the full-vocabulary path drops the -inf columns, the fast path never makes them."""
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(tiny_target, draft_vocab_size=4)
    drafter = _BothPaths(draft, branching=6, depth=3, nodes=20)
    prompt = [5, 6, 7, 8, 9]
    out, _ = speculative_generate(tiny_target, prompt, drafter,
                                  GenerationConfig(max_new_tokens=8, temperature=0, stop_on_eos=False))
    assert out == greedy(tiny_target, prompt, 8)
    for ref, fast in drafter.pairs:
        assert _same_tree(ref, fast)
        assert set(fast.tokens[1:].tolist()) <= set(draft.target_ids().tolist())
    assert drafter.pairs[0][1].size == 1 + 4 + 4 * 4  # every candidate kept: 4 per node


@torch.no_grad()
def test_root_logprobs_view_and_a_wrapped_run(tiny_target, trained):  # noqa: F811
    """``root_logprobs`` (full vocabulary) is built lazily from the draft-vocabulary row; wrapping
    ``rows.run`` (an observer) routes every row through it, as before."""
    drafter = Eagle3Drafter(trained.draft, branching=3, depth=3, nodes=8)
    rows = drafter.rows
    seen = []
    run = rows.run

    def observing(ids, hidden, positions, mask=None, side=None):
        h, logp = run(ids, hidden, positions, mask, side)
        seen.append(logp.shape)
        return h, logp

    cfg = GenerationConfig(max_new_tokens=6, temperature=0, stop_on_eos=False)
    out, _ = speculative_generate(tiny_target, UNSEEN_PROMPT, drafter, cfg)
    assert seen == [] and rows._root_full is None  # nothing read the full-vocabulary view
    ids = trained.draft.target_ids()
    full = drafter.root_logprobs
    assert full.shape == (tiny_target.geometry.vocab_size,)
    torch.testing.assert_close(full[ids], rows.root_draft_logprobs, rtol=0, atol=0)
    assert torch.isneginf(full).sum() == full.numel() - ids.numel()
    rows.run = observing
    assert rows.observed and rows.reference
    again, _ = speculative_generate(tiny_target, UNSEEN_PROMPT, drafter, cfg)
    assert again == out
    assert seen and all(s[-1] == tiny_target.geometry.vocab_size for s in seen)


# ---- 2. vectorised build_dynamic_tree == the per-candidate reference ---------------------------------------


def _reference_tree(root_token, expand, *, branching, depth, nodes) -> DraftTree:
    """``build_dynamic_tree`` as it was written before vectorising (per-candidate Python, best-first heap)."""
    cand_tokens, cand_parents, cand_depth, cand_scores = [int(root_token)], [-1], [0], [0.0]
    max_candidates = 1 + branching + max(depth - 1, 0) * branching * branching
    ancestors = torch.zeros(max_candidates, max_candidates, dtype=torch.bool)
    ancestors[0, 0] = True
    frontier = [0]
    for level in range(depth if nodes > 0 else 0):
        num = len(cand_tokens)
        batch = FrontierBatch(
            node_ids=torch.tensor(frontier, dtype=torch.long),
            tokens=torch.tensor([cand_tokens[i] for i in frontier], dtype=torch.long),
            parents=torch.tensor([cand_parents[i] for i in frontier], dtype=torch.long),
            depth=level,
            ancestor_mask=ancestors[frontier, :num].clone(),
            scores=torch.tensor([cand_scores[i] for i in frontier], dtype=torch.float32),
        )
        logprobs = expand(batch)
        k = min(branching, logprobs.shape[-1])
        top_vals, top_ids = torch.topk(logprobs.float(), k, dim=-1)
        child_scores = batch.scores[:, None] + top_vals
        new_ids, new_scores = [], []
        for row, parent in enumerate(frontier):
            for col in range(k):
                score = float(child_scores[row, col])
                if score != score or score == float("-inf"):
                    continue
                new_ids.append(len(cand_tokens))
                new_scores.append(score)
                cand_tokens.append(int(top_ids[row, col]))
                cand_parents.append(parent)
                cand_depth.append(level + 1)
                cand_scores.append(score)
        if not new_ids:
            break
        new = torch.tensor(new_ids, dtype=torch.long)
        ancestors[new] = ancestors[torch.tensor([cand_parents[i] for i in new_ids], dtype=torch.long)]
        ancestors[new, new] = True
        order = sorted(range(len(new_ids)), key=lambda j: -new_scores[j])[:branching]
        frontier = [new_ids[j] for j in sorted(order)]
    # Selection by the shipped heap search: the tree under test selects by sorting instead (the heap is only
    # its fallback), so the two paths still check each other.
    selected = _best_first(cand_parents, cand_scores, nodes)
    selected.sort(key=lambda c: (cand_depth[c], c))
    new_index = {c: i for i, c in enumerate(selected)}
    return DraftTree.from_parents([cand_tokens[c] for c in selected],
                                  [-1] + [new_index[cand_parents[c]] for c in selected[1:]], deterministic=True)


class _Table:
    """Log-probs by the frontier node's token; records the frontiers it was shown."""

    def __init__(self, table: torch.Tensor, as_candidates: int | None = None):
        self.table, self.as_candidates, self.calls = table, as_candidates, []

    def __call__(self, batch: FrontierBatch):
        self.calls.append(batch)
        logp = self.table[batch.tokens]  # [F, V]
        if self.as_candidates is None:
            return logp
        values, ids = torch.topk(logp, min(self.as_candidates, logp.shape[-1]), dim=-1)
        return TopCandidates(values, ids)


def _tables(seed: int, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)  # [V, V]
    impossible = logp.clone()
    impossible[:, torch.randperm(vocab, generator=gen)[: vocab // 3]] = float("-inf")  # a reduced vocabulary
    coarse = torch.log_softmax(torch.randint(0, 3, (vocab, vocab), generator=gen).float(), -1)  # many ties
    positive = torch.randn(vocab, vocab, generator=gen)  # not log-probs: children may outrank parents
    nan = logp.clone()
    nan[0, 1] = float("nan")
    return {"logp": logp, "impossible": impossible, "coarse": coarse, "uniform": torch.zeros(vocab, vocab),
            "positive": positive, "nan": nan}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("branching", "depth", "nodes"),
                         [(1, 4, 4), (2, 3, 5), (3, 3, 6), (3, 4, 10), (4, 5, 30), (6, 3, 100), (3, 0, 5), (3, 3, 0)])
def test_vectorised_tree_equals_the_reference(seed, branching, depth, nodes):
    for name, table in _tables(seed, 9).items():
        ref = _reference_tree(2, _Table(table), branching=branching, depth=depth, nodes=nodes)
        got_drafter = _Table(table)
        got = build_dynamic_tree(2, got_drafter, branching=branching, depth=depth, nodes=nodes)
        assert _same_tree(ref, got), (name, ref.tokens.tolist(), got.tokens.tolist(), ref.parents.tolist(),
                                      got.parents.tolist())
        # What the drafter is shown per level is unchanged too.
        ref_calls = _Table(table)
        _reference_tree(2, ref_calls, branching=branching, depth=depth, nodes=nodes)
        assert len(ref_calls.calls) == len(got_drafter.calls)
        for a, b in zip(ref_calls.calls, got_drafter.calls):
            for field in ("node_ids", "tokens", "parents", "ancestor_mask", "scores"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)
            assert a.depth == b.depth
        if name in ("logp", "impossible"):  # no exact ties: top-k order is unambiguous
            # Already-chosen candidates (fewer columns than branching allowed, more are cut) give the same tree.
            for k in (branching, branching + 2):
                cand = build_dynamic_tree(2, _Table(table, as_candidates=k), branching=branching, depth=depth,
                                          nodes=nodes)
                assert _same_tree(ref, cand), name


def test_top_candidates_shape_is_checked():
    def bad(batch):
        return TopCandidates(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))

    with pytest.raises(ValueError, match="TopCandidates"):
        build_dynamic_tree(0, bad, branching=3, depth=2, nodes=4)


# ---- 3. a bf16 draft ------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("kw", [{"dtype": "bfloat16"}, {"head_dtype": "bf16"}])
def test_bf16_draft_is_lossless(tiny_target, trained, kw):  # noqa: F811
    drafter = Eagle3Drafter(trained.draft, branching=4, depth=4, nodes=16, **kw)
    layer_dtype = torch.bfloat16 if "dtype" in kw else torch.float32
    assert drafter.compute_draft is not trained.draft
    assert drafter.compute_draft.fc.weight.dtype == layer_dtype
    assert drafter.compute_draft.lm_head.weight.dtype == torch.bfloat16
    assert trained.draft.fc.weight.dtype == trained.draft.lm_head.weight.dtype == torch.float32  # untouched
    accepted = 0
    for prompt in TRAIN_PROMPTS[:2] + [UNSEEN_PROMPT]:
        out, stats = speculative_generate(tiny_target, prompt, drafter,
                                          GenerationConfig(max_new_tokens=24, temperature=0, stop_on_eos=False))
        assert out == greedy(tiny_target, prompt, 24)
        accepted += sum(stats.accept_lengths) - stats.rounds  # draft tokens accepted (bonus tokens excluded)
    assert accepted > 10  # the bf16 draft still proposes what the trained draft learned
    assert drafter.cache.k.dtype == layer_dtype
    assert drafter.root_logprobs.dtype == drafter.rows.root_draft_logprobs.dtype == torch.float32
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.7, seed=3, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, TRAIN_PROMPTS[2], drafter, cfg)
    again, _ = speculative_generate(tiny_target, TRAIN_PROMPTS[2], drafter, cfg)
    assert len(out) == 16 and out == again
    assert sum(stats.accept_lengths) == len(out) - 1


@torch.no_grad()
def test_bf16_copy_follows_the_drafts_weights(tiny_target):
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(tiny_target, draft_vocab_size=64)
    drafter = Eagle3Drafter(draft, branching=2, depth=2, nodes=3, dtype=torch.bfloat16)
    assert Eagle3Drafter(draft, dtype="float32").compute_draft is draft  # already that dtype: no copy
    with pytest.raises(ValueError, match="dtype"):
        Eagle3Drafter(draft, dtype="int8")
    cfg = GenerationConfig(max_new_tokens=3, stop_on_eos=False)
    speculative_generate(tiny_target, [5, 6, 7, 8], drafter, cfg)
    draft.lm_head.weight.mul_(2.0)  # e.g. training went on between two evaluations
    speculative_generate(tiny_target, [5, 6, 7, 8], drafter, cfg)  # reset re-syncs the cast copy
    torch.testing.assert_close(drafter.compute_draft.lm_head.weight, draft.lm_head.weight.bfloat16(), rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32, 33])
def test_draft_linear_kernels_compute_the_product(rows, dtype):
    from draftlab.methods.eagle3.model import DraftLinear

    torch.manual_seed(0)
    lin = DraftLinear(48, 200, bias=False).to(dtype)
    x = torch.randn(2, rows, 48).to(dtype)[1:]  # [1, rows, 48]
    ref = x.float() @ lin.weight.float().T  # [1, rows, 200]
    y = lin(x)
    assert y.shape == (1, rows, 200) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    with torch.enable_grad():  # training runs F.linear
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=0, atol=0)
