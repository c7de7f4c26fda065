"""End-to-end losslessness under sampling: the engine's output sequence has the target's distribution.

The verifier's rules are proven in test_verify_distribution.py; this checks the loop around them (which
logits row meets which node, what gets committed, the bonus token) with a stub target whose next-token
distribution depends on the current token, so the exact joint law of three emitted tokens is known.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from draftlab.decoding.drafter import Drafter
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree
from tests.stubs import TableTarget

V = 4
N_RUNS = 4000


class TableDrafter(Drafter):
    """Chain drafter from its own bigram table: sampled (with q) or greedy (deterministic)."""

    def __init__(self, table, depth, sampled):
        self.q, self.depth, self.sampled = torch.softmax(table, -1), depth, sampled

    def propose(self, state):
        toks, rows, cur = [], [], state.root
        for _ in range(self.depth):
            q = self.q[cur]
            cur = int(torch.multinomial(q, 1, generator=state.generator)) if self.sampled else int(q.argmax())
            toks.append(cur)
            rows.append(q)
        if self.sampled:
            return DraftTree.chain(state.root, toks, draft_probs=torch.stack(rows))
        return DraftTree.chain(state.root, toks)


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_engine_output_follows_target_joint_law(sampled, temperature):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5
    draft = table + torch.randn(V, V, generator=g)  # a related but different drafter
    target = TableTarget(table, vocab_size=V)
    p = logits_to_probs(table, temperature)  # [V, V] next-token law given the current token
    expected = {seq: float(p[0, seq[0]] * p[seq[0], seq[1]] * p[seq[1], seq[2]])
                for seq in itertools.product(range(V), repeat=3)}
    counts = dict.fromkeys(expected, 0)
    cfg = dict(max_new_tokens=3, temperature=temperature, stop_on_eos=False)
    for i in range(N_RUNS):
        out, _ = speculative_generate(target, [0], TableDrafter(draft, 2, sampled), GenerationConfig(seed=i, **cfg))
        counts[tuple(out)] += 1
    keys = sorted(expected)
    obs = [counts[k] for k in keys]
    total = sum(expected.values())  # 1 up to float32 rounding; chisquare wants exact totals
    exp = [expected[k] / total * N_RUNS for k in keys]
    tv = 0.5 * sum(abs(o / N_RUNS - e / N_RUNS) for o, e in zip(obs, exp))
    assert chisquare(obs, exp).pvalue > 1e-3
    # Expected TV of an exact sampler with 64 outcomes and n draws is about 0.5*sqrt(64/n) ~ 0.05.
    assert tv < 0.5 * (len(keys) / N_RUNS) ** 0.5 + 3 / N_RUNS ** 0.5


def test_wrong_engine_would_be_caught():
    """Negative control: accepting every draft unconditionally fails the same test."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5
    draft = table + torch.randn(V, V, generator=g)
    q = torch.softmax(draft, -1)
    p = torch.softmax(table, -1)
    counts: dict = {}
    for i in range(2000):
        gen = torch.Generator().manual_seed(i)
        x1 = int(torch.multinomial(p[0], 1, generator=gen))
        x2 = int(torch.multinomial(q[x1], 1, generator=gen))  # draft accepted blindly
        x3 = int(torch.multinomial(q[x2], 1, generator=gen))
        counts[(x1, x2, x3)] = counts.get((x1, x2, x3), 0) + 1
    keys = list(itertools.product(range(V), repeat=3))
    obs = [counts.get(k, 0) for k in keys]
    exp = [float(p[0, a] * p[a, b] * p[b, c]) for a, b, c in keys]
    exp = [e / sum(exp) * 2000 for e in exp]
    assert chisquare(obs, exp).pvalue < 1e-3
