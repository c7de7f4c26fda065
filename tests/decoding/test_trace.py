"""``speculative_generate(..., trace=True)``: the per-round rollout record is consistent with the output and
with the target, and costs no extra target pass."""

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.reference_drafters import OracleDrafter
from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree
from draftlab.methods.prompt_lookup import PromptLookupDrafter
from tests.decoding.test_engine_sampling import TableDrafter
from tests.decoding.test_engine_stub import CYCLE, FixedDrafter
from tests.stubs import TableTarget


class _Counting:
    """Delegates to a target and counts its forward calls."""

    def __init__(self, target):
        self.target, self.calls = target, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.target.forward(*args, **kwargs)


def _check_consistent(prompt, out, stats):
    """Emitted tokens, kept counts and anchors are what the trace's paths and bonuses say."""
    trace = stats.trace
    assert len(trace) == stats.rounds
    assert [out[0]] + [t for r in trace for t in r.emitted] == out
    assert [r.kept for r in trace] == stats.accept_lengths
    assert [r.tokens.numel() for r in trace] == stats.tree_sizes
    anchor = len(prompt)
    for r in trace:
        assert r.anchor == anchor  # the root sits right after the committed context
        n = r.tokens.numel()
        assert r.target_logprobs.shape[0] == n and r.target_logprobs.device.type == "cpu"
        assert r.path[0] == 0 and all(r.parents[b] == a for a, b in zip(r.path, r.path[1:]))
        assert r.rejected == [c for c in range(n) if int(r.parents[c]) == r.path[-1]]
        assert 1 <= r.kept <= len(r.path)
        anchor += len(r.path)


def _check_against_fresh_forward(target, prompt, out, stats, atol):
    """Target log-probs at every kept path node equal a plain causal forward over prompt + output."""
    seq = prompt + out
    fresh = torch.log_softmax(target.forward(torch.tensor([seq])).logits[0].float(), -1)  # [T, V]
    checked = 0
    for r in stats.trace:
        for depth, node in enumerate(r.path[: r.kept]):
            pos = r.anchor + depth
            assert int(r.tokens[node]) == seq[pos]
            torch.testing.assert_close(r.target_logprobs[node], fresh[pos], rtol=0, atol=atol)
            checked += 1
    assert checked == len(out) - 1  # every emitted token but the prefill's sits on a kept path node


def _tree(r):
    # root -> {wrong, a}; a -> {wrong, b}; b -> {wrong}: each round accepts a, b and rejects b's child.
    a, b = CYCLE[r], CYCLE[CYCLE[r]]
    tokens = [r, (a % 9) + 1, a, 7 if b != 7 else 6, b, 9 if CYCLE[b] != 9 else 8]
    return DraftTree.from_parents(tokens, [-1, 0, 0, 2, 2, 4])


def test_trace_on_a_stub_tree():
    target = TableTarget(CYCLE)
    prompt = [0]
    out, stats = speculative_generate(target, prompt, FixedDrafter(_tree), GenerationConfig(max_new_tokens=9,
                                      stop_on_eos=False), trace=True)
    assert out == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _check_consistent(prompt, out, stats)
    first = stats.trace[0]
    # Root -> node 2 (node 1 rejected on the way), node 2 -> node 4; node 4's child 5 is rejected.
    assert first.path == [0, 2, 4] and first.rejected == [5] and first.bonus == 4 and first.kept == 3
    assert first.draft_probs is None and first.deterministic
    torch.testing.assert_close(first.target_logprobs, torch.log_softmax(target.table[first.tokens], -1))
    # The budget cut the last round: kept < len(path), so neither the last path node nor the bonus was emitted.
    assert stats.accept_lengths == [3, 3, 2]
    last = stats.trace[-1]
    assert last.kept == 2 and len(last.path) == 3 and last.emitted == [8, 9]


def test_trace_of_sampled_proposals_carries_their_draft_probs():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4, 4, generator=g)
    target = TableTarget(table, vocab_size=4)
    drafter = TableDrafter(table + torch.randn(4, 4, generator=g), depth=3, sampled=True)
    prompt = [0]
    out, stats = speculative_generate(target, prompt, drafter, GenerationConfig(max_new_tokens=40, temperature=1.0,
                                      seed=1, stop_on_eos=False), trace=True)
    _check_consistent(prompt, out, stats)
    for r in stats.trace:
        assert not r.deterministic and r.draft_probs.shape == (4, 4)
        torch.testing.assert_close(r.draft_probs[1:], drafter.q[r.tokens[:-1]])
    assert any(len(r.path) > 1 for r in stats.trace)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("branches", [1, 3])
def test_trace_matches_a_fresh_target_forward(tiny_target, temperature, branches):
    prompt = [5, 6, 7, 8, 9] * 6
    cfg = GenerationConfig(max_new_tokens=30, temperature=temperature, seed=0, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, prompt, PromptLookupDrafter(6, num_branches=branches), cfg,
                                      trace=True)
    _check_consistent(prompt, out, stats)
    _check_against_fresh_forward(tiny_target, prompt, out, stats, atol=1e-4)
    if temperature == 0:
        assert out == autoregressive_generate(tiny_target, prompt, cfg)[0]
        for r in stats.trace:
            assert r.bonus == int(r.target_logprobs[r.path[-1]].argmax())
            assert r.bonus not in r.tokens[r.rejected].tolist()
    else:
        # The verify distribution is recoverable from the stored log-probs.
        r = stats.trace[0]
        p = logits_to_probs(r.target_logprobs[0], temperature)
        assert p[r.bonus if len(r.path) == 1 else int(r.tokens[r.path[1]])] > 0


def test_trace_costs_no_target_pass(tiny_target):
    prompt = list(range(40, 60))
    cfg = GenerationConfig(max_new_tokens=21, temperature=0.9, seed=3, stop_on_eos=False)
    ref = autoregressive_generate(tiny_target, prompt, GenerationConfig(max_new_tokens=40, stop_on_eos=False))[0]
    runs = []
    for trace in (False, True):
        counting = _Counting(tiny_target)
        out, stats = speculative_generate(counting, prompt, OracleDrafter(depth=4, reference=ref), cfg, trace=trace)
        runs.append((out, counting.calls, stats.rounds))
    assert runs[0] == runs[1]  # same tokens, same number of target calls
    out, calls, rounds = runs[1]
    assert calls == 1 + rounds  # prefill + one verify pass per round
    assert stats.trace is not None and speculative_generate(tiny_target, prompt, None, cfg)[1].trace is None
