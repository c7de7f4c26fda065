"""End-to-end losslessness under sampling: the engine's output sequence has the target's distribution.

The verifier's rules are proven in test_verify_distribution.py; this checks the loop around them (which
logits row meets which node, what gets committed, the bonus token) with a stub target whose next-token
distribution depends on the current token, so the exact joint law of three emitted tokens is known. The
check is ``stats.assert_matches`` (chi-square over bins pooled to expected counts >= 5, and a TV bound);
a floor on the drafts accepted in the first round (half its analytic mean) fails an engine that never
accepts anything, which would be exact too.

Over seeds, an exact sampler fails a case's distribution check by chance at these rates, measured
offline by ``python -m tests.decoding.stats`` (500k numpy multinomial samples of each case's 64-outcome
law, n = 4000, through the same check; method in tests/decoding/stats.py): T=0.7 0.040%, T=1 0.033%
(binomial standard error 0.003%; the law does not depend on the drafter). The former check, chi-square
over the 64 unpooled bins at p > 1e-3, failed 4.2% (T=0.7) and 0.41% (T=1) of the same samples.
"""

import pytest
import torch

import draftlab.decoding.engine as engine_module
from draftlab.decoding.drafter import Drafter
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree
from tests.decoding.bigram import never_accept
from tests.decoding.stats import assert_matches, assert_min_acceptance, assert_rejected
from tests.stubs import TableTarget

V = 4
N_RUNS = 4000
DEPTH = 2


class TableDrafter(Drafter):
    """Chain drafter from its own bigram table: sampled (with q) or greedy (deterministic)."""

    def __init__(self, table, depth, sampled):
        self.q, self.depth, self.sampled = torch.softmax(table, -1), depth, sampled
        self.accepted: list[int] = []  # drafts accepted per round

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

    def update(self, state, out):
        self.accepted.append(len(out.result.path) - 1)


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5
    draft = table + torch.randn(V, V, generator=g)  # a related but different drafter
    return table, draft


def _joint(p: torch.Tensor) -> torch.Tensor:
    """``[V, V, V]`` law of three emitted tokens after prompt token 0, given the next-token law ``p [V, V]``."""
    p = p.double()
    return p[0][:, None, None] * p[:, :, None] * p[None]


def _expected_first_round_accepted(p: torch.Tensor, q: torch.Tensor, sampled: bool) -> float:
    # The first round's root r ~ p[0] (the prefill's token); a depth-2 chain from r. Sampled: x1 = a is
    # accepted with probability min(p, q)(a | r), then x2 likewise given a. Greedy: the argmax chain
    # (x1, x2) is accepted step by step with probability p(x1 | r), then p(x2 | x1).
    p, q = p.double(), q.double()
    total = 0.0
    for r in range(V):
        if sampled:
            first = torch.minimum(p[r], q[r])  # [V]
            deeper = torch.minimum(p, q).sum(-1)  # [V] acceptance probability of x2 given x1
            e_r = float((first * (1 + deeper)).sum())
        else:
            x1 = int(q[r].argmax())
            x2 = int(q[x1].argmax())
            e_r = float(p[r, x1] * (1 + p[x1, x2]))
        total += float(p[0, r]) * e_r
    return total


def exact_laws() -> dict:
    """name -> (runs, exact law of a run's three tokens, first-token marginal checked): what ``python -m
    tests.decoding.stats`` simulates. The law does not depend on the drafter, so one entry per temperature
    stands for both drafters."""
    table, _ = _tables()
    return {f"T{t}": (N_RUNS, _joint(logits_to_probs(table, t)).numpy(), False) for t in (0.7, 1.0)}


def _run_engine(sampled: bool, temperature: float, n: int = N_RUNS) -> tuple[torch.Tensor, float]:
    """Counts ``[V, V, V]`` of the three tokens of ``n`` seeded runs, and the mean drafts accepted in the
    first round."""
    table, draft = _tables()
    target = TableTarget(table, vocab_size=V)
    counts = torch.zeros(V, V, V, dtype=torch.long)
    accepted = 0
    cfg = dict(max_new_tokens=3, temperature=temperature, stop_on_eos=False)
    for i in range(n):
        drafter = TableDrafter(draft, DEPTH, sampled)
        out, _ = speculative_generate(target, [0], drafter, GenerationConfig(seed=i, **cfg))
        counts[tuple(out)] += 1
        accepted += drafter.accepted[0]
    return counts, accepted / n


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_engine_output_follows_target_joint_law(sampled, temperature):
    table, draft = _tables()
    p = logits_to_probs(table, temperature)  # [V, V] next-token law given the current token
    counts, accepted = _run_engine(sampled, temperature)
    assert_matches(counts, _joint(p))
    assert_min_acceptance(accepted, _expected_first_round_accepted(p, torch.softmax(draft, -1), sampled))


def test_never_accepting_engine_fails_the_acceptance_floor(monkeypatch):
    """Negative control: an engine whose verifier rejects every draft emits the target's law exactly;
    only the acceptance floor catches it."""
    monkeypatch.setattr(engine_module, "verify", never_accept)
    table, draft = _tables()
    p = logits_to_probs(table, 1.0)
    counts, accepted = _run_engine(True, 1.0, n=N_RUNS // 4)
    assert_matches(counts, _joint(p))
    assert accepted == 0
    with pytest.raises(AssertionError, match="mean accepted drafts"):
        assert_min_acceptance(accepted, _expected_first_round_accepted(p, torch.softmax(draft, -1), True))


def test_wrong_engine_would_be_caught():
    """Negative control: accepting every draft unconditionally fails the same check."""
    table, draft = _tables()
    q = torch.softmax(draft, -1)
    p = torch.softmax(table, -1)
    counts = torch.zeros(V, V, V, dtype=torch.long)
    for i in range(2000):
        gen = torch.Generator().manual_seed(i)
        x1 = int(torch.multinomial(p[0], 1, generator=gen))
        x2 = int(torch.multinomial(q[x1], 1, generator=gen))  # draft accepted blindly
        x3 = int(torch.multinomial(q[x2], 1, generator=gen))
        counts[x1, x2, x3] += 1
    assert_rejected(counts, _joint(p))
