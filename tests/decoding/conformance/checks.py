"""The conformance checks every method config must pass, as plain functions of (target, drafter factory).

They are functions rather than tests so that ``test_mutants.py`` can run the very same checks against
deliberately broken drafters / engines and assert that they fail.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing

import numpy as np
import torch
from scipy import stats as scipy_stats

from draftlab.decoding.drafter import Drafter, VerifyOutput
from draftlab.decoding.engine import (
    GenerationConfig,
    autoregressive_generate,
    scratch_for,
    speculative_generate,
)
from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree
from tests.draft_store import shared_json, target_identity

P_VALUE_MIN = 1e-3


def check_tree(tree: DraftTree, root: int, vocab: int, max_rows: int) -> None:
    """The invariants ``decoding.tree`` documents and the engine and verifier rely on."""
    n = tree.size
    parents, depth = tree.parents.tolist(), tree.depth.tolist()
    assert int(tree.tokens[0]) == root, "node 0 must be the last committed token"
    assert parents[0] == -1 and depth[0] == 0
    assert all(0 <= parents[i] < i for i in range(1, n)), f"not in topological order: {parents}"
    assert all(depth[i] == depth[parents[i]] + 1 for i in range(1, n)), "depth != parent depth + 1"
    assert bool(((tree.tokens >= 0) & (tree.tokens < vocab)).all()), "token outside the target vocabulary"
    assert n <= max_rows, f"{n} tree rows > the {max_rows} the drafter reserves"
    if not tree.deterministic:
        q = tree.draft_probs.float()  # on the drafter's device: every index and reference below is made there
        assert q.shape == (n, vocab)
        assert bool((q >= 0).all()) and torch.allclose(q[1:].sum(-1), torch.ones(n - 1, device=q.device), atol=1e-4)
        # Each sampled node's token must be possible under the distribution it was drawn from.
        rows = torch.arange(1, n, device=q.device)
        assert bool((q[rows, tree.tokens[1:].to(q.device)] > 0).all()), "a sampled token has q(x) = 0"


class Checked(Drafter):
    """Forwards every call to ``inner`` and checks each proposed tree (and each update's bookkeeping)."""

    def __init__(self, inner: Drafter, vocab: int, scratch: int):
        self.inner, self.vocab, self.scratch = inner, vocab, scratch
        self.trees = 0

    def taps(self, target):
        return self.inner.taps(target)

    def scratch_rows(self, cfg):
        return self.inner.scratch_rows(cfg)

    def extra_rows(self, state, tree):
        return self.inner.extra_rows(state, tree)

    def attention_rows(self):
        return self.inner.attention_rows()

    def verify_forward(self, state, tree):
        return self.inner.verify_forward(state, tree)

    def sequence_stats(self):
        return self.inner.sequence_stats()

    def close(self):
        self.inner.close()

    def reset(self, state):
        self.inner.reset(state)

    def propose(self, state):
        tree = self.inner.propose(state)
        check_tree(tree, state.root, self.vocab, self.scratch)
        self.trees += 1
        return tree

    def update(self, state, out: VerifyOutput):
        assert 1 <= out.kept <= len(out.result.path)
        assert out.logits.shape[0] == out.tree.size
        self.inner.update(state, out)


def run(target, drafter: Drafter, prompt: list[int], cfg: GenerationConfig, engine=speculative_generate):
    checked = Checked(drafter, target.geometry.vocab_size, scratch_for(cfg, drafter))
    out, stats = engine(target, prompt, checked, cfg, trace=True)
    assert checked.trees == stats.rounds
    # The trace is the round record: emitted tokens are its paths + bonuses.
    assert [out[0]] + [t for r in stats.trace for t in r.emitted] == out
    return out, stats


# One scratch row: the engine must reserve what the drafter declares in ``scratch_rows``, nothing else.
DECLARED_ONLY = 1


def check_greedy_equals_ar(target, make_drafter: Callable[[], Drafter], prompts: list[list[int]], n: int, *,
                           engine=speculative_generate, stop_on_eos: bool = False, fixed_target: bool = False) -> int:
    """Greedy speculative output == greedy AR, token for token; returns the draft tokens accepted.

    ``fixed_target``: the caller vouches that ``target``'s weights are what its identity (name, dtype, shape)
    says, never changed by a test (a session fixture's real model): its AR continuations are then decoded
    once per run and shared by every check and worker (``tests/draft_store.py``)."""
    cfg = GenerationConfig(max_new_tokens=n, temperature=0.0, stop_on_eos=stop_on_eos, scratch_rows=DECLARED_ONLY)
    accepted = 0
    with closing(make_drafter()) as drafter:  # the owner closes what it builds
        for prompt in prompts:  # one drafter across sequences: reset must start afresh
            out, stats = run(target, drafter, prompt, cfg, engine)
            if fixed_target:
                key = {"ar": prompt, "n": n, "stop_on_eos": stop_on_eos, "target": target_identity(target)}
                ar = shared_json(key, lambda p=prompt: autoregressive_generate(target, p, cfg)[0])
            else:
                ar, _ = autoregressive_generate(target, prompt, cfg)
            assert out == ar, f"greedy speculative output differs from AR at {next(i for i, (a, b) in enumerate(zip(out + [None], ar + [None])) if a != b)}"
            accepted += sum(len(r.path) - 1 for r in stats.trace)
    return accepted


def _pooled_chisquare(obs: list[float], exp: list[float], min_expected: float = 5.0) -> float:
    """Chi-square p-value with adjacent bins pooled until each expects >= ``min_expected``; one bin = no test."""
    groups: list[list[float]] = []
    for o, e in zip(obs, exp):
        if groups and groups[-1][1] < min_expected:
            groups[-1][0] += o
            groups[-1][1] += e
        else:
            groups.append([o, e])
    if len(groups) > 1 and groups[-1][1] < min_expected:  # a small tail joins its neighbour
        o, e = groups.pop()
        groups[-1][0] += o
        groups[-1][1] += e
    if len(groups) < 2:
        return 1.0
    o = [g[0] for g in groups]
    e = [g[1] * sum(o) / sum(g[1] for g in groups) for g in groups]
    return float(scipy_stats.chisquare(o, e).pvalue)


def _bin_tails(obs: list[float], exp: list[float]) -> float:
    """Bonferroni-corrected two-sided Poisson tail p-value of the most surprising bin count."""
    total = sum(obs) / max(sum(exp), 1e-300)
    tails = [min(scipy_stats.poisson.sf(o - 1, e * total), scipy_stats.poisson.cdf(o, e * total))
             for o, e in zip(obs, exp) if e > 0]
    return float(min(1.0, 2 * len(tails) * min(tails))) if tails else 1.0


def check_sampling(target, make_drafter: Callable[[], Drafter], prompts: list[list[int]], *, n: int, seeds,
                   temperature: float, top_k: int | None = None, top_p: float | None = None,
                   engine=speculative_generate) -> dict:
    """Sampled speculative output follows the target's distribution, token by token.

    For every emitted token ``y_t`` (after the prefill's), with ``p_t`` the target's sampling distribution
    given the prefix (``logits_to_probs`` of a fresh causal forward over prompt + output: independent of
    the engine), the randomised PIT value ``u_t = F_t(y_t-) + U p_t(y_t)`` over the vocabulary sorted by
    decreasing ``p_t`` is uniform on (0, 1) and independent of the past exactly when ``y_t ~ p_t``. So the
    ``u_t`` are i.i.d. uniform for a lossless engine: a KS test, plus a chi-square on the rank of the
    emitted token (argmax / ranks 2-4 / the rest), whose expected counts are sums of ``p_t``.

    The most sensitive check is conditional on the trees: a deterministic tree (top-k candidates) is
    chosen without any of the coins, so given the tree the token emitted after a path node is still
    ``p_t``-distributed, and it lands among that node's drafted children ``C_t`` with probability exactly
    ``p_t(C_t)``. A lossy rule (a skipped correction, sampled candidates verified as if deterministic)
    emits drafted tokens too often; a z-test on the count (an exact Poisson tail when few hits are
    expected) catches it. Sampled trees are left out of it: their candidates are drawn with the coupling
    of speculative sampling, so given a sampled child the emission is not ``p_t``; for them the marginal
    KS and chi-square tests carry the check. Also returns how many draft tokens were accepted (a check that passes with nothing accepted
    proves little).
    """
    with closing(make_drafter()) as drafter:  # the owner closes what it builds
        u_gen = torch.Generator().manual_seed(1234)
        us: list[float] = []
        obs = torch.zeros(3, dtype=torch.float64)
        exp = torch.zeros(3, dtype=torch.float64)
        accepted = 0
        hits, hit_mass, hit_var = 0.0, 0.0, 0.0
        for prompt in prompts:
            for seed in seeds:
                cfg = GenerationConfig(max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                       stop_on_eos=False, scratch_rows=DECLARED_ONLY)
                out, stats = run(target, drafter, prompt, cfg, engine)
                accepted += sum(len(r.path) - 1 for r in stats.trace)
                seq = prompt + out
                with torch.no_grad():
                    ids = torch.tensor([seq], device=target.device)
                    all_logits = target.forward(ids).logits[0].float().cpu()  # [T, V] row j: token j + 1
                p_all = logits_to_probs(all_logits, temperature, top_k, top_p).double()  # [T, V]
                for r in stats.trace:
                    if not r.deterministic:
                        # A sampled tree is drawn together with the acceptance coins (speculative sampling's
                        # coupling): given a sampled child x, the emitted token is x with min(1, p/q) >> p(x).
                        # Only trees chosen independently of all coins support the conditional test.
                        continue
                    parents = r.parents.tolist()
                    for k, node in enumerate(r.path[: r.kept]):
                        kids = sorted({int(r.tokens[c]) for c in range(len(parents)) if parents[c] == node})
                        if not kids:
                            continue
                        mass = float(p_all[r.anchor + k, kids].sum())
                        hits += float(seq[r.anchor + k + 1] in kids)
                        hit_mass += mass
                        hit_var += mass * (1 - mass)
                p = p_all[len(prompt):len(seq) - 1]  # [n-1, V]
                y = torch.tensor(out[1:])  # [n-1]
                sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)  # [n-1, V]
                rank = (order == y[:, None]).nonzero()[:, 1]  # [n-1]
                before = torch.cumsum(sorted_p, -1) - sorted_p  # [n-1, V]
                rows = torch.arange(len(y))
                py = sorted_p[rows, rank]  # [n-1]
                assert bool((py > 0).all()), "emitted a token the target cannot emit"
                us += (before[rows, rank] + torch.rand(len(y), generator=u_gen, dtype=torch.float64) * py).tolist()
                bins = torch.bucketize(rank, torch.tensor([1, 4]), right=True)  # 0: argmax, 1: ranks 2-4, 2: rest
                obs += torch.bincount(bins, minlength=3).double()
                exp += torch.stack([sorted_p[:, :1].sum(-1), sorted_p[:, 1:4].sum(-1), sorted_p[:, 4:].sum(-1)], 1).sum(0)
    ks = float(scipy_stats.kstest(us, "uniform").pvalue)
    # Pooling keeps the chi-square honest but blurs rare bins (at T=1 the target's argmax is itself rare),
    # where a lossy rule shows first; each bin's count is also compared with its exact Poisson tail (a sum of
    # rare Bernoullis; conservative for common bins), Bonferroni over the bins.
    chi = min(_pooled_chisquare(obs.tolist(), exp.tolist()), _bin_tails(obs.tolist(), exp.tolist()))
    z = (hits - hit_mass) / max(hit_var, 1e-12) ** 0.5
    if hit_var >= 10:
        z_p = float(2 * scipy_stats.norm.sf(abs(z)))
    else:
        # Few expected hits: a sum of rare Bernoullis is Poisson, far from normal (one hit against an
        # expected 0.02 is a 2 % event, not z = 6.4); two-sided exact tail.
        tail = min(scipy_stats.poisson.sf(hits - 1, hit_mass), scipy_stats.poisson.cdf(hits, hit_mass))
        z_p = float(min(1.0, 2 * tail))
    result = {"ks": ks, "chi2": chi, "drafted_z": z, "drafted_p": z_p, "drafted_hits": hits,
              "drafted_expected": hit_mass, "samples": len(us), "accepted": accepted, "observed": obs.tolist(),
              "expected": exp.tolist()}
    assert min(ks, chi, z_p) > P_VALUE_MIN, f"emitted tokens do not follow the target: {result}"
    return result


# A sharp temperature, where drafts trained on greedy continuations are accepted often, and T=1, where a
# draft that samples its proposals (a block drafter's chain) is accepted at all after a few training steps
# and where a false claim about q (top-k candidates passed off as samples) shifts the emitted ranks most.
SAMPLING_TEMPERATURES = (0.1, 1.0)


def check_sampling_temperatures(target, make_drafter: Callable[[], Drafter], prompts: list[list[int]], *, n: int,
                                seeds, temperatures=SAMPLING_TEMPERATURES, engine=speculative_generate) -> int:
    """``check_sampling`` at each temperature; returns the draft tokens accepted over all of them."""
    return sum(check_sampling(target, make_drafter, prompts, n=n, seeds=seeds, temperature=t,
                              engine=engine)["accepted"] for t in temperatures)


# ---- the powered check: the law of a round's first emitted tokens, over many independent trials ----------

# Rank bins of an emitted token under its own target law: the argmax, the 2nd, the 3rd, the 4th-5th, the
# 6th-20th, the rest. A drafter that biases the output almost always moves mass between the top ranks (a
# draft's favourite tokens are the target's likely ones), so a few coarse bins keep the power there.
RANK_EDGES = (1, 2, 3, 5, 20)
# Monte-Carlo replicates of the exact null, and the false-failure rate of one check: the p-value is
# (1 + replicates at least as extreme) / (1 + NULL_SAMPLES), a valid p-value, so an exact engine fails a
# check with probability at most ALPHA_FIRST_ROUND whatever the target, drafter or trial count.
NULL_SAMPLES = 40_000
ALPHA_FIRST_ROUND = 1e-4


def _rank_bin_laws(target, prefixes: list[list[int]], tokens: list[int], temperature: float, top_k, top_p
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prefix, the target's law over the rank bins ``[n, B]`` and the bin of ``tokens[i]`` ``[n]``."""
    unique = sorted({tuple(p) for p in prefixes})
    index = {p: i for i, p in enumerate(unique)}
    rows = []
    with torch.no_grad():
        for start in range(0, len(unique), 256):  # equal lengths: one batched forward per chunk
            batch = torch.tensor(unique[start:start + 256], device=target.device)
            rows.append(target.forward(batch).logits[:, -1].float().cpu())  # [b, V]; the statistics run on the host
    probs = logits_to_probs(torch.cat(rows), temperature, top_k, top_p).double()  # [U, V]
    rows_of = torch.tensor([index[tuple(p)] for p in prefixes])  # [n]
    ranks = torch.cat([_ranks(probs[rows_of[i:i + 64]], torch.tensor(tokens[i:i + 64]), "emitted a token the target "
                              "cannot emit") for i in range(0, len(tokens), 64)])  # [n]
    return _bin_mass(probs)[rows_of], torch.bucketize(ranks, torch.tensor(RANK_EDGES), right=True)


def _ranks(probs: torch.Tensor, tokens: torch.Tensor, impossible: str) -> torch.Tensor:
    """Each row's rank of its token ``[m]`` in ``probs [m, V]`` sorted by descending probability, equal
    probabilities in token-id order (a fixed order: the bin a token lands in never depends on the draw). O(V)
    per row, where a sort of 49k entries per row was most of a check's statistics. A token of zero probability
    fails with ``impossible``."""
    mine = probs.gather(-1, tokens[:, None])  # [m, 1]
    assert bool((mine > 0).all()), impossible
    ids = torch.arange(probs.shape[-1])
    return (probs > mine).sum(-1) + ((probs == mine) & (ids < tokens[:, None])).sum(-1)  # [m]


def _bin_mass(probs: torch.Tensor) -> torch.Tensor:
    """The mass of each rank bin ``[m, B]`` of ``probs [m, V]``: the top ``RANK_EDGES[-1]`` values in order,
    summed bin by bin, and the rest (which tokens hold a tied value does not change a bin's mass)."""
    top = torch.topk(probs, min(RANK_EDGES[-1], probs.shape[-1]), dim=-1).values  # [m, 20], descending
    edges = [0, *RANK_EDGES]
    bins = [top[:, a:b].sum(-1) for a, b in zip(edges[:-1], edges[1:])]
    return torch.stack(bins + [(probs.sum(-1) - top.sum(-1)).clamp_min(0.0)], -1)  # [m, B]


def _statistics(counts: np.ndarray, expected: np.ndarray, variance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pearson's X^2 and the largest |z| of cell counts ``[..., C]`` against their exact means/variances."""
    x2 = ((counts - expected) ** 2 / np.maximum(expected, 1e-12)).sum(-1)
    z = (np.abs(counts - expected) / np.sqrt(np.maximum(variance, 1e-12))).max(-1)
    return x2, z


def first_round_p_value(laws: np.ndarray, observed: np.ndarray, *, samples: int = NULL_SAMPLES, seed: int = 0
                        ) -> tuple[float, dict]:
    """Exact-null p-value of observed cells.

    ``laws [n, C]``: trial i's law over the C cells (rows sum to one: every trial lands in exactly one cell
    per counted token; stack the cells of several tokens side by side and pass one law block per token via
    ``observed``'s shape). ``observed [n, K]``: the cell of each of the trial's K counted tokens, as an index
    into that token's block of ``C / K`` columns. Trials are independent under the null, each cell draw
    from its own row, so the null distribution of any statistic of the counts is simulated exactly; the
    statistic is the smaller of two Monte-Carlo p-values (Pearson's X^2 and the largest |z|, Bonferroni).
    """
    n, k = observed.shape
    block = laws.shape[1] // k
    expected = laws.sum(0)  # [C]
    variance = (laws * (1 - laws)).sum(0)  # [C]
    counts = np.zeros(laws.shape[1])
    for j in range(k):
        counts[j * block:(j + 1) * block] = np.bincount(observed[:, j], minlength=block)
    x2_obs, z_obs = _statistics(counts, expected, variance)
    rng = np.random.default_rng(seed)
    cum = [np.cumsum(laws[:, j * block:(j + 1) * block], -1) for j in range(k)]  # K x [n, block]
    x2_null, z_null = [], []
    chunk = max(1, 4_000_000 // (n * block))
    for start in range(0, samples, chunk):
        s = min(chunk, samples - start)
        sims = []
        offsets = (np.arange(s) * block)[:, None]  # [s, 1]: replicate r's cells at r * block ...
        for c in cum:
            u = rng.random((s, n))
            cell = np.zeros((s, n), dtype=np.int64)  # [s, n]: inverse-CDF draw of each trial's cell,
            for edge in c[:, :-1].T:  # one cumulative edge at a time (no [s, n, block] temporary)
                cell += u >= edge
            sims.append(np.bincount((cell + offsets).ravel(), minlength=s * block).reshape(s, block))  # [s, block]
        x2, z = _statistics(np.concatenate(sims, -1).astype(np.float64), expected, variance)
        x2_null.append(x2)
        z_null.append(z)
    x2_null, z_null = np.concatenate(x2_null), np.concatenate(z_null)
    p_x2 = (1 + int((x2_null >= x2_obs - 1e-9).sum())) / (1 + samples)
    p_z = (1 + int((z_null >= z_obs - 1e-9).sum())) / (1 + samples)
    p = min(1.0, 2 * min(p_x2, p_z))
    return p, {"x2": float(x2_obs), "max_z": float(z_obs), "p_x2": p_x2, "p_z": p_z,
               "observed": counts.tolist(), "expected": expected.round(2).tolist()}


def _drafted_rank_bin(r) -> tuple[np.ndarray, int] | None:
    """A sampled round's first drafted token (the root's first child): the law over rank bins of the
    distribution the drafter reports it was drawn from ``[B]``, and the bin it landed in. None for
    deterministic trees and rounds with nothing drafted.

    The verifier's acceptance rule for sampled trees is exact only if each drafted token was drawn from the
    law reported beside it. A drafter that draws from one law and reports another (a reshape reported
    without it, a temperature or nucleus cut reported differently) changes the emitted tokens only in the
    rounds where its token is accepted; its drafted tokens show the slip in every round."""
    kids = (r.parents == 0).nonzero().flatten()
    if r.deterministic or r.draft_probs is None or len(kids) == 0:
        return None
    child = int(kids[0])
    q = r.draft_probs[child].double().cpu()[None]  # [1, V] as reported
    rank = int(_ranks(q, r.tokens[child].reshape(1).cpu().long(), "drafted a token its reported law cannot draw")[0])
    law = _bin_mass(q)[0].numpy()
    return law / law.sum(), int(np.searchsorted(np.array(RANK_EDGES), rank, side="right"))


def check_first_round_law(target, make_drafter: Callable[[], Drafter], prompt: list[int], *, temperature: float,
                          trials: int, top_k: int | None = None, top_p: float | None = None,
                          engine=speculative_generate, alpha: float = ALPHA_FIRST_ROUND, at: int = 1) -> dict:
    """Sampling exactness with power: the law of the first tokens a drafter's first round emits.

    Each trial decodes 3 tokens from ``prompt`` with its own seed: ``y1`` comes from the prefill (the target
    alone), ``y2`` and ``y3`` from the drafter's first round (or, when it emits only its bonus, the second).
    For a lossless engine ``y2 ~ p(. | prompt, y1)`` and ``y3 ~ p(. | prompt, y1, y2)`` exactly, given
    anything the drafter carried over from earlier trials (its state only depends on the past, and the rule
    holds given any past), so the trials are independent draws of known laws: the rank bins of ``y2`` and
    ``y3`` under their own target laws (``RANK_EDGES``) are categorical draws with known probabilities,
    and ``first_round_p_value`` computes an exact p-value by simulating them. An exact engine fails with
    probability at most ``alpha``.

    Why this has power where the marginal checks have not: every trial starts at the same prompt, where a
    trained draft is accepted (a prompt from its training corpus), at a temperature that leaves the target
    far from uniform, so the first slot's proposal is accepted often and any bias in how it was drawn,
    cut or reported shows in the rank-0 bin. Power, measured (``test_checks.py``): over 300 trials a shift of
    about 0.15 in the top bin's probability is seen at p < 1e-3; what a drafting slip shifts is the accepted
    share of rounds times its bias, so a draft that is rarely accepted hides it (``test_drafter_mutants.py``
    gives the check a draft that is accepted, and kills each slip there). Returns the statistics and the
    draft tokens accepted in first rounds (a check that passes with nothing accepted proves little).

    A second family looks at the drafts themselves: in every trial's first round, when sampled, the root's
    first child must have been drawn from the law reported beside it
    (``_drafted_rank_bin``: its rank bin under that law, a categorical draw of known probabilities). A slip
    that draws from one law and reports another shows there in every round, accepted or not; the two
    families are combined by Bonferroni (2 x the smaller p-value), so ``alpha`` still bounds a false failure.

    ``at``: test the output tokens ``at`` and ``at + 1`` instead of 1 and 2 (each under its law given the
    prompt and the output before it), for drafters whose interesting rounds come later (SSD's first cached
    chain is verified in the second round); fixed positions, never positions chosen by how rounds fell, which
    would condition on the verifier's coins. Accepted tokens are then counted over every round, and the drafted
    tokens of every round enter the second family.
    """
    with closing(make_drafter()) as drafter:  # the owner closes what it builds
        rows, accepted, first = [], 0, []
        for seed in range(trials):
            cfg = GenerationConfig(max_new_tokens=at + 2, temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=seed, stop_on_eos=False, scratch_rows=DECLARED_ONLY)
            out, stats = run(target, drafter, prompt, cfg, engine)
            accepted += sum(len(r.path) - 1 for r in (stats.trace[:1] if at == 1 else stats.trace))
            rows.append(out[:at + 2])
            # Each round's first child is a draw from the law reported beside it, given everything before it:
            # with ``at`` > 1 every round's counts (SSD's cached chains come in later rounds).
            first.extend(_drafted_rank_bin(r) for r in (stats.trace[:1] if at == 1 else stats.trace))
    y = np.array(rows)  # [n, at + 2]
    law2, bin2 = _rank_bin_laws(target, [prompt + r[:at] for r in y.tolist()], y[:, at].tolist(),
                                temperature, top_k, top_p)
    law3, bin3 = _rank_bin_laws(target, [prompt + r[:at + 1] for r in y.tolist()], y[:, at + 1].tolist(),
                                temperature, top_k, top_p)
    laws = torch.cat([law2, law3], -1).numpy()  # [n, 2B]
    p, result = first_round_p_value(laws, torch.stack([bin2, bin3], -1).numpy())
    drafted = [d for d in first if d is not None]
    if drafted:  # the drafted tokens against their reported laws; Bonferroni with the two statistics above
        # 2.5x the replicates: after both Bonferroni steps the floor, 4 / (1 + samples), sits under alpha.
        p_draft, seen = first_round_p_value(np.stack([law for law, _ in drafted]),
                                            np.array([[b] for _, b in drafted]), samples=100_000, seed=1)
        p = min(1.0, 2 * min(p, p_draft))
        result.update(drafted_p=p_draft, drafted_max_z=seen["max_z"], drafted_observed=seen["observed"],
                      drafted_expected=seen["expected"])
    result.update(p=p, trials=trials, accepted=accepted, temperature=temperature)
    assert p > alpha, f"the first round's tokens do not follow the target: {result}"
    return result
