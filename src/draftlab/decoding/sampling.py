"""Logits -> probabilities -> tokens: the only place in draftlab where logits become a distribution.

The speculative verifier, the drafters and the autoregressive baseline all call ``logits_to_probs`` with
the same sampling settings, so "the target distribution" means one thing everywhere. Lossless sampling is
defined with respect to exactly this function: speculative output must be distributed as repeated
``sample(logits_to_probs(target_logits, ...))``.
"""

from __future__ import annotations

import torch


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Turn logits ``[..., V]`` into fp32 probabilities ``[..., V]`` under the sampling settings.

    Order of operations: temperature scaling, then top-k, then top-p (nucleus), then renormalisation.

    - ``temperature == 0`` is greedy: a one-hot distribution on the argmax (ties resolve to the lowest
      token id, as ``torch.argmax``); ``top_k``/``top_p`` cannot change the argmax and are ignored.
    - ``top_k``: keep the ``top_k`` largest logits; logits tied with the k-th largest are all kept (the
      same convention as Hugging Face's ``TopKLogitsWarper``), so the kept set never depends on how a
      sort orders ties. ``None`` or ``top_k <= 0`` or ``top_k >= V`` disables it.
    - ``top_p``: keep the smallest set of most-probable tokens whose mass is ``>= top_p`` (ties in the
      ranking go to the lower token id); the argmax is always kept, so ``top_p <= 0`` keeps the argmax alone.
      ``None`` or ``top_p >= 1`` disables it.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        index = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, index, 1.0)  # [..., V]

    scaled = logits / temperature if temperature != 1.0 else logits  # [..., V]
    vocab = scaled.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # [..., V]
    probs = torch.softmax(scaled, dim=-1)  # [..., V]

    if top_p is not None and top_p < 1.0:
        # A stable sort makes the ranking of equal probabilities deterministic (lower id first).
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [..., V]
        # Mass strictly before each token: a token is needed while the mass before it is still < top_p.
        # The first token has exactly zero mass before it, so a positive threshold always keeps the
        # argmax; flooring top_p keeps "top_p <= 0" meaning "argmax only" (every other token has at
        # least p_max >= 1/V before it).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
        kept_sorted = sorted_probs.masked_fill(mass_before >= max(top_p, 1e-12), 0.0)  # [..., V]
        probs = torch.zeros_like(probs).scatter_(-1, order, kept_sorted)  # [..., V]
        probs = probs / probs.sum(dim=-1, keepdim=True)  # [..., V]
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per distribution from ``probs [..., V]``; returns a LongTensor of shape ``[...]``.

    Inverse-CDF sampling: one uniform ``u`` in (0, 1] per row, and the first token whose cumulative mass
    reaches ``u`` times the row's total. A token of zero mass adds nothing to the running sum, so it is
    never the first to reach it; a one-hot row (greedy) always returns its hot index. The sums run in
    float64, so the law is the row's up to ~1e-16. Why not ``torch.multinomial``: on CPU it costs ~1 ms per
    49k-token row (its validation passes and per-row set-up), 17x this, and the engine draws one token per
    drafted node and per round. ``generator`` makes draws reproducible; it must live on ``probs``' device.
    Rows need not sum exactly to one, but must be non-negative and finite with positive mass.
    """
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sample: every row of probs needs a finite, positive total mass")
    # 1 - rand: u in (0, 1], so the threshold is > 0 (a leading zero-mass token is never picked) and
    # <= total (the index never runs past the last token with mass).
    u = 1.0 - torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)  # [..., 1]
    return torch.searchsorted(cdf, u * total).squeeze(-1)  # [...]: first index with cdf >= u * total
