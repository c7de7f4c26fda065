"""The powered check's p-value is what it claims: uniform under the null, small under a bias of the size
a drafting slip causes (numpy only: no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from tests.decoding.conformance.checks import RANK_EDGES, _bin_mass, _ranks, first_round_p_value

TRIALS, REPLICATES, NULL = 300, 200, 1_000


def _laws(rng) -> np.ndarray:
    # Per trial, a law over 6 rank bins shaped like tiny_random's at T = 0.3 (the top bin ~0.4), two tokens.
    one = rng.dirichlet([8, 4, 3, 3, 2, 2], size=TRIALS)  # [n, 6]
    return np.concatenate([one, rng.dirichlet([8, 4, 3, 3, 2, 2], size=TRIALS)], -1)  # [n, 12]


def _draw(rng, laws: np.ndarray, shift: float = 0.0) -> np.ndarray:
    """Each trial's two bins, drawn from its laws with ``shift`` of the mass moved from the other bins to bin 0."""
    out = np.empty((len(laws), 2), dtype=np.int64)
    for j in range(2):
        law = laws[:, 6 * j:6 * (j + 1)] * (1 - shift)
        law[:, 0] += shift
        u = rng.random((len(laws), 1))
        out[:, j] = (u >= np.cumsum(law, -1)[:, :-1]).sum(-1)
    return out


def test_p_values_are_uniform_for_an_exact_sampler():
    rng = np.random.default_rng(0)
    ps = []
    for _ in range(REPLICATES):
        laws = _laws(rng)
        ps.append(first_round_p_value(laws, _draw(rng, laws), samples=NULL, seed=int(rng.integers(1 << 31)))[0])
    ps = np.array(ps)
    # The Bonferroni factor 2 makes the p-value conservative (never anti-conservative): P(p <= a) <= a.
    for a in (0.05, 0.2, 0.5):
        assert (ps <= a).mean() <= scipy_stats.binom.ppf(1 - 1e-4, REPLICATES, a) / REPLICATES, (a, (ps <= a).mean())
    assert (ps <= 0.5).mean() > 0.2, "the p-value is far too conservative to have power"


def test_a_small_shift_to_the_top_bin_is_seen():
    rng = np.random.default_rng(1)
    laws = _laws(rng)
    p, stats = first_round_p_value(laws, _draw(rng, laws, shift=0.25), samples=20_000)
    assert p < 1e-3, stats


class _ElsewhereTarget:
    """A target that reports another device than its inputs' default and refuses inputs not placed on it; its
    logits come back on that device's stand-in (the CPU here), as a GPU target's would before ``.cpu()``."""

    device = torch.device("meta")

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[torch.device] = []

    def forward(self, input_ids, *args, **kwargs):
        self.seen.append(input_ids.device)
        assert input_ids.device == self.device, f"input on {input_ids.device}, target on {self.device}"
        return self.inner.forward(torch.zeros(input_ids.shape, dtype=torch.long), *args, **kwargs)


def test_rank_bin_laws_send_their_prefixes_to_the_targets_device(tiny_target):
    # On a CUDA target the harness once built its prefixes on the CPU and crashed (found by experiments/gpu_check).
    from tests.decoding.conformance.checks import _rank_bin_laws

    target = _ElsewhereTarget(tiny_target)
    laws, bins = _rank_bin_laws(target, [[5, 6, 7], [5, 6, 8]], [1, 2], 1.0, None, None)
    assert target.seen == [torch.device("meta")] and laws.shape[0] == 2 and bins.shape == (2,)


def test_rank_bins_are_those_of_a_stable_sort():
    """The O(V) ranks and bin masses equal a full stable sort's (ties in token-id order), zeros and ties
    included, for vocabularies smaller and larger than the last rank edge."""
    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        vocab = int(torch.randint(4, 200, (1,), generator=g))
        p = torch.rand(3, vocab, generator=g, dtype=torch.float64)
        if trial % 2:
            p = (p * 4).floor()  # many ties, some zeros
        p[:, 0] += 0.01
        p = p / p.sum(-1, keepdim=True)
        tokens = torch.stack([torch.multinomial(p[i].float(), 1, generator=g)[0] for i in range(3)])
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        rank_of = torch.empty_like(order).scatter_(-1, order, torch.arange(vocab).expand_as(order))
        edges = [0, *RANK_EDGES, vocab]
        bins = torch.stack([sorted_p[:, a:b].sum(-1) for a, b in zip(edges[:-1], edges[1:])], -1)
        assert torch.equal(_ranks(p, tokens, "impossible"), rank_of[torch.arange(3), tokens]), trial
        torch.testing.assert_close(_bin_mass(p), bins, rtol=0, atol=1e-12)
    zero = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    with pytest.raises(AssertionError, match="impossible"):
        _ranks(zero, torch.tensor([2]), "impossible")
