from __future__ import annotations

import math

import pytest
import torch

from draftlab.decoding.sampling import logits_to_probs, sample


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    for temperature in (0.5, 1.0, 2.0):
        torch.testing.assert_close(logits_to_probs(logits, temperature), torch.softmax(logits / temperature, -1))


def test_output_is_fp32_and_keeps_batch_shape():
    logits = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    probs = logits_to_probs(logits, 0.8, top_k=3, top_p=0.9)
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_greedy_is_one_hot_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 5.0, 5.0]])
    probs = logits_to_probs(logits, 0.0, top_k=2, top_p=0.1)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_negative_temperature_is_rejected():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(3), -0.5)


def test_top_k_keeps_the_k_largest_and_renormalises():
    probs = logits_to_probs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_k_keeps_ties_with_the_kth_value():
    probs = logits_to_probs(_logits([0.4, 0.2, 0.2, 0.2]), 1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.2, 0.2, 0.2]))


@pytest.mark.parametrize("top_k", [None, 0, 4, 10])
def test_top_k_disabled(top_k):
    logits = torch.randn(4)
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=top_k), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.75, [0, 1]),  # 0.5 + 0.3 = 0.8 >= 0.75: the smallest set reaching the mass
        (0.85, [0, 1, 2]),
        (0.4, [0]),
        (0.0, [0]),  # the argmax is always kept
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    base = [0.5, 0.3, 0.15, 0.05]
    order = [2, 0, 3, 1]  # scramble the vocabulary so the sort back to token order is exercised
    logits = _logits([base[order.index(i)] for i in range(4)])
    probs = logits_to_probs(logits, 1.0, top_p=top_p)
    kept_ids = sorted(order[i] for i in kept)
    mass = sum(base[i] for i in kept)
    expected = torch.zeros(4)
    for i in kept:
        expected[order[i]] = base[i] / mass
    torch.testing.assert_close(probs, expected)
    assert (probs > 0).nonzero().flatten().tolist() == kept_ids


def test_top_k_is_applied_before_top_p():
    # top-k 2 leaves [4/7, 3/7]; nucleus 0.5 on that keeps only the argmax. Applied to the original
    # distribution, top-p 0.5 would have kept two tokens (0.4 < 0.5).
    probs = logits_to_probs(_logits([0.4, 0.3, 0.2, 0.1]), 1.0, top_k=2, top_p=0.5)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_is_applied_before_truncation():
    logits = _logits([0.5, 0.3, 0.2])
    # At T=1, top-p 0.75 keeps two tokens; at T=0.25 the argmax alone holds > 0.75 of the mass.
    assert (logits_to_probs(logits, 1.0, top_p=0.75) > 0).sum() == 2
    assert (logits_to_probs(logits, 0.25, top_p=0.75) > 0).sum() == 1


def test_sample_shapes_and_reproducibility():
    probs = torch.softmax(torch.randn(3, 5, 11), -1)
    first = sample(probs, torch.Generator().manual_seed(7))
    again = sample(probs, torch.Generator().manual_seed(7))
    assert first.shape == (3, 5) and first.dtype == torch.long
    assert torch.equal(first, again)
    one = sample(probs[0, 0], torch.Generator().manual_seed(7))
    assert one.shape == () and 0 <= int(one) < 11


def test_sample_one_hot_returns_the_hot_index():
    probs = logits_to_probs(torch.tensor([[0.0, 2.0, 1.0], [9.0, 0.0, 1.0]]), 0.0)
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [1, 0]


def test_sample_frequencies():
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    draws = sample(probs.expand(20_000, 4), torch.Generator().manual_seed(0))  # [20000]
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[2] == 0
    # 5 standard deviations of a Bernoulli(0.6) mean over 20k draws is ~0.017.
    assert (freq - probs.double()).abs().max() < 5 * math.sqrt(0.25 / 20_000)


def test_sample_never_draws_zero_mass_tokens_at_either_end():
    # Inverse-CDF edges: u = 1 must stop at the last token with mass, a tiny u must skip leading zeros.
    probs = torch.tensor([0.0, 0.0, 1e-6, 0.5, 0.0, 0.5 - 1e-6, 0.0, 0.0])
    draws = sample(probs.expand(50_000, 8), torch.Generator().manual_seed(1))
    assert set(torch.unique(draws).tolist()) <= {2, 3, 5}
    assert sample(torch.eye(8), torch.Generator().manual_seed(0)).tolist() == list(range(8))
    with pytest.raises(ValueError, match="positive total mass"):
        sample(torch.zeros(2, 4))
