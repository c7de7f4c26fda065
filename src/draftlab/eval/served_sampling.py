"""Served parity at T > 0: the engine's acceptance and draftlab's compared as distributions.

At T = 0 both sides emit the same tokens, so their counters can be compared prompt by prompt
(``served_metrics.parity_check``). When both sides sample, outputs differ and so do the rounds; what should
agree is the acceptance each side reaches *on average* over the randomness. So each prompt is asked with S seeds
on each side (``eval.served.seeds``), and per side this gives τ = 1 + Σaccepted / Σdrafts and the per-position
rates (accepted at draft position i / draft rounds), with intervals from a cluster bootstrap over prompts
(resample prompts with replacement, each prompt's seeds pooled: the seeds of one prompt are not independent
draws of the bench). The gap served - draftlab per position and for τ is paired over the prompts of a
resample; its intervals are simultaneous (Bonferroni over the k + 1 gaps) so that "agree" fails by chance about
1 - level of the time whatever k, and expanded for few prompts (``expanded_level``: a plain percentile bootstrap
over 12 prompts said "differ" for 15% of same-distribution pairs at 95% in simulation, the expanded one 7%).
Verdict: ``agree`` when every gap interval contains 0, else ``differ`` with
a hint from the pattern (which positions moved, which way), as the T = 0 check prints its checklist.

Requests carry the temperature, a seed and every sampling field the OpenAI / vLLM request knows at its neutral
value (``NEUTRAL``): vLLM fills a field a request leaves out from the model's ``generation_config.json``
(``--generation-config auto``, its default: temperature, top_p, top_k, min_p and the penalties), which would
quietly change the target distribution on the served side only.

Verification rules (vLLM 0.32, ``v1/sample/rejection_sampler.py``, ``v1/spec_decode/llm_base_proposer.py``,
``config/speculative.py``): its drafters draft greedily by default (``draft_sample_method="greedy"``: the
draft's argmax, no draft probabilities, so the verifier takes q one-hot and accepts with probability p(x), the
residual being p without x). That is draftlab's deterministic-candidate rule, so an argmax chain (EAGLE-3 as a
chain, DFlash with ``sampling=argmax``; vLLM's EAGLE and DFlash proposers share that base) is verified alike
on both sides. A draftlab chain of *sampled* drafts
(DFlash's default ``sampling=sample``: accept with min(1, p(x)/q(x))) runs another lossless rule: acceptance
then differs by design, not by a bug. ``draft_sample_method="probabilistic"`` makes vLLM sample its drafts at
the request's temperature (its top-k / top-p are not applied to the draft) and use min(1, p/q).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from statistics import NormalDist
from typing import Any

import numpy as np

from draftlab.eval.served_metrics import SpecCounters, chain_counters, query_server
from draftlab.utils.errors import ConfigError

# Every sampling field of vLLM's chat request that a generation_config.json default would otherwise fill.
NEUTRAL: dict[str, Any] = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                           "presence_penalty": 0.0, "frequency_penalty": 0.0}
DEFAULT_SEEDS = 3


# -- settings and the two sides -------------------------------------------------------------------------------

def seed_list(seeds: Any) -> list[int]:
    """``eval.served.seeds``: a count S (seeds 0..S-1) or the seeds themselves."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        out = list(range(seeds))
    elif isinstance(seeds, list | tuple):
        out = list(seeds)
    else:
        out = []
    if not out or any(not isinstance(x, int) or isinstance(x, bool) for x in out) or len(set(out)) != len(out):
        raise ConfigError(f"expected a positive count or a list of distinct int seeds, got {seeds!r}",
                          field="eval.served.seeds")
    return out


def sampling_settings(cfg_eval, s: dict[str, Any]) -> dict[str, Any] | None:
    """The sampled comparison's settings (temperature, seeds, top_p, top_k), None at T = 0."""
    temperature = float(cfg_eval.get("temperature") or 0.0)
    if temperature <= 0:
        return None
    top_p, top_k = cfg_eval.get("top_p"), cfg_eval.get("top_k")
    return {"temperature": temperature, "seeds": seed_list(s["seeds"]),
            "top_p": None if top_p is None else float(top_p), "top_k": None if top_k is None else int(top_k)}


def request_params(temperature: float, seed: int, top_p: float | None = None, top_k: int | None = None
                   ) -> dict[str, Any]:
    """The request fields of one seeded, sampled query (unset truncations at their neutral values)."""
    return {**NEUTRAL, "temperature": float(temperature), "seed": int(seed),
            **({} if top_p is None else {"top_p": float(top_p)}), **({} if top_k is None else {"top_k": int(top_k)})}


def query_seeded(url: str, prompts: list[str], *, temperature: float, seeds: list[int], top_p: float | None = None,
                 top_k: int | None = None, max_tokens: int, model: str, timeout: float = 600.0, settle: float = 0.2,
                 desc: str = "served") -> dict[str, Any]:
    """Every prompt once per seed, one request at a time: ``{counters, tokens, hit}``, the first two indexed
    ``[prompt][seed]``; ``hit`` counts answers that reached ``max_tokens``."""
    runs = [query_server(url, prompts, max_tokens=max_tokens, model=model, timeout=timeout, settle=settle,
                         desc=f"{desc} T={temperature:g} seed={seed}",
                         params=request_params(temperature, seed, top_p, top_k))[0] for seed in seeds]
    per_prompt = list(zip(*runs))
    return {"counters": [[a.counters for a in row] for row in per_prompt],
            "tokens": [[a.token_ids if a.token_ids is not None else a.text for a in row] for row in per_prompt],
            "hit": sum(a.new_tokens >= max_tokens for row in per_prompt for a in row)}


class _RuleProbe:
    """The drafter as the engine sees it, noting which acceptance rule each round's tree asked for (a sampled
    tree carries its draft probabilities; a deterministic one is verified with q one-hot)."""

    def __init__(self, drafter):
        self._drafter, self.rules = drafter, set()

    def propose(self, state):
        tree = self._drafter.propose(state)
        self.rules.add("deterministic" if tree.deterministic else "sampled")
        return tree

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)


def draftlab_seeded(target, drafter, prompts: list[str], *, k: int, max_tokens: int, temperature: float,
                    seeds: list[int], top_p: float | None = None, top_k: int | None = None) -> dict[str, Any]:
    """The same first turns through draftlab's engine, sampled, once per seed: ``{counters, tokens, rule}`` (the
    first two ``[prompt][seed]``; ``rule``: deterministic | sampled | mixed). Closes ``drafter``."""
    from tqdm.auto import tqdm

    from draftlab.data.template import render_prompt
    from draftlab.decoding.engine import GenerationConfig, speculative_generate

    probe = _RuleProbe(drafter)
    counters, tokens = [], []
    try:
        for prompt in tqdm(prompts, desc=f"draftlab chain k={k} T={temperature:g}", unit="prompt"):
            ids = render_prompt(target.tokenizer, [{"role": "user", "content": prompt}])
            row_c, row_t = [], []
            for seed in seeds:
                gen = GenerationConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                       seed=int(seed))
                out, stats = speculative_generate(target, ids, probe, gen)
                row_c.append(chain_counters(stats.accept_lengths, k))
                row_t.append(list(out))
            counters.append(row_c)
            tokens.append(row_t)
    finally:
        drafter.close()  # the drafter is this function's, as in draftlab_chain
    rule = "mixed" if len(probe.rules) > 1 else next(iter(probe.rules), None)
    return {"counters": counters, "tokens": tokens, "rule": rule}


def varied(tokens: list[list[Any]]) -> int:
    """Prompts whose seeds gave more than one distinct output (a side that ignored the temperature gives 0)."""
    return sum(len({tuple(t) if isinstance(t, list) else t for t in row}) > 1 for row in tokens)


# -- statistics -----------------------------------------------------------------------------------------------

def _table(counters: list[list[SpecCounters]], k: int) -> np.ndarray:
    """Per prompt (seeds pooled): [drafts, accepted, accepted at position 0..k-1]."""
    rows = []
    for per_seed in counters:
        c = sum(per_seed, SpecCounters())
        pos = list(c.per_pos[:k]) + [0.0] * (k - len(c.per_pos[:k]))
        rows.append([c.drafts, c.accepted, *pos])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), 2 + k)  # [P, 2 + k]


def _stats(tot: np.ndarray) -> np.ndarray:
    """From pooled sums [..., 2 + k]: [τ, rate_0..rate_{k-1}, conditional_0..conditional_{k-1}] (NaN where a
    denominator is 0). Conditional rate i: accepted at i / reached i (position 0: / drafts)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        drafts = tot[..., :1]
        tau = 1.0 + tot[..., 1:2] / drafts
        rates = tot[..., 2:] / drafts
        reached = np.concatenate([drafts, tot[..., 2:-1]], axis=-1)
        cond = tot[..., 2:] / reached
    out = np.concatenate([tau, rates, cond], axis=-1)
    return np.where(np.isfinite(out), out, np.nan)


def expanded_level(level: float, n: int) -> float:
    """The percentile level of an *expanded* percentile interval (Hesterberg 2015): a bootstrap over n clusters
    understates the spread by about sqrt((n-1)/n) and its normal tails are too thin for few clusters, so the
    percentiles are taken where a normal quantile equals sqrt(n/(n-1)) times Student's t with n-1 degrees of
    freedom. At a dozen prompts this widens a 95% interval by about a fifth; at hundreds, barely."""
    if n < 2:
        return level
    z = NormalDist().inv_cdf((1 + level) / 2)
    nu = n - 1
    # Student's t quantile from the normal one (Cornish-Fisher, Abramowitz & Stegun 26.7.5): no scipy at run time
    t = z + ((z**3 + z) / 4 / nu + (5 * z**5 + 16 * z**3 + 3 * z) / 96 / nu**2
             + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384 / nu**3
             + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160 / nu**4)
    return 2 * NormalDist().cdf(math.sqrt(n / nu) * t) - 1


def _interval(values: np.ndarray, level: float) -> list[list[float] | None]:
    """Percentile intervals per column over the finite resamples (None for a column without any)."""
    out = []
    for col in values.T:
        col = col[np.isfinite(col)]
        out.append(None if not col.size else
                   [float(np.quantile(col, (1 - level) / 2)), float(np.quantile(col, (1 + level) / 2))])
    return out


def _num(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


def cluster_bootstrap(served: list[list[SpecCounters]], draftlab: list[list[SpecCounters]], *, k: int,
                      resamples: int = 2000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Both sides' τ and per-position rates with intervals, and their gaps (served - draftlab) with simultaneous
    intervals, from one bootstrap over prompts (each prompt's seeds pooled; the same prompts on both sides)."""
    if len(served) != len(draftlab):
        raise ValueError(f"paired prompts needed: {len(served)} served vs {len(draftlab)} draftlab")
    a, b = _table(served, k), _table(draftlab, k)
    n = len(a)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [R, P]
    sa, sb = _stats(a[idx].sum(axis=1)), _stats(b[idx].sum(axis=1))  # [R, 1 + 2k]
    gap_level = 1 - (1 - level) / (k + 1)  # k + 1 gaps judged together: τ and each position
    point_a, point_b = _stats(a.sum(axis=0)), _stats(b.sum(axis=0))  # [1 + 2k]
    side_q, gap_q = expanded_level(level, n), expanded_level(gap_level, n)
    ci_a, ci_b, ci_gap = _interval(sa, side_q), _interval(sb, side_q), _interval(sa - sb, gap_q)

    def side(point, ci):
        return {"tau": _num(point[0]), "tau_ci": ci[0], "position_rates": [_num(x) for x in point[1:k + 1]],
                "position_ci": ci[1:k + 1], "conditional_rates": [_num(x) for x in point[k + 1:]]}

    gap = point_a - point_b

    def entry(i):
        return {"gap": _num(gap[i]), "ci": ci_gap[i]}

    return {"served": side(point_a, ci_a), "draftlab": side(point_b, ci_b),
            "gaps": {"tau": entry(0), "positions": [entry(i) for i in range(1, k + 1)],
                     "conditional": [entry(i) for i in range(k + 1, 2 * k + 1)], "level": gap_level},
            "test": f"cluster bootstrap over {n} prompts (seeds pooled), {resamples} resamples, expanded percentiles; "
                    f"sides {level:.0%} CI, gaps simultaneous {level:.0%} ({gap_level:.1%} each of {k + 1})"}


def _excludes_zero(e: dict[str, Any]) -> bool:
    return e["ci"] is not None and not e["ci"][0] <= 0.0 <= e["ci"][1]


# -- verdict and hints ----------------------------------------------------------------------------------------

def pattern_of(gaps: dict[str, Any]) -> str | None:
    """Which positions moved, judged on the conditional rates (accepted at i given position i was reached), so
    that a shift at position 0 is not counted again at every deeper position it carries into."""
    moved = [i for i, e in enumerate(gaps["conditional"]) if _excludes_zero(e)]
    if not moved:
        moved = [i for i, e in enumerate(gaps["positions"]) if _excludes_zero(e)]
    if not moved:
        return "tau only" if _excludes_zero(gaps["tau"]) else None
    if moved == [0]:
        return "position 0 only"
    return "deeper positions" if 0 not in moved else "position 0 and deeper"


_PATTERN_HINTS = {
    "position 0 only": "only the first draft position moved (deeper ones agree once reached): what the draft's "
                       "first step starts from after a sampled token (the target's features at a bonus or recovered "
                       "token, the token it conditions on), or the target distribution where acceptance is highest",
    "deeper positions": "position 0 agrees and deeper positions moved: the draft's own context past its first step "
                        "(KV / hidden states of its own drafted tokens: positions, what is kept after a rejection); "
                        "for sampled drafts, whether the temperature is applied to the draft at every step",
    "position 0 and deeper": "positions move together: the distributions the verifier compares differ throughout: "
                             "temperature applied on one side only (to the target or to the draft), server sampling "
                             "defaults (generation_config temperature / top_p / top_k / min_p / repetition penalty: "
                             "the request sends each, so only a server or proxy that drops them), or the "
                             "verification rule",
    "tau only": "τ moved but no single position did: a small shift spread over positions (more prompts or seeds "
                "would say where)",
}


def sampled_causes(rec: dict[str, Any], greedy: dict[str, Any] | None = None) -> list[str]:
    """Likely causes of a 'differ' verdict, most specific first: a hint from the pattern, not a diagnosis."""
    causes, n = [], rec["n_prompts"]
    sv, dv = rec["served"].get("varied"), rec["draftlab"].get("varied")
    if len(rec["seeds"]) > 1 and sv == 0 and dv:
        causes.append("the server's outputs did not vary across seeds on any prompt: it decoded greedily (the "
                      "request's temperature did not reach its sampler)")
    if len(rec["seeds"]) > 1 and dv == 0 and sv:
        causes.append("draftlab's outputs did not vary across seeds: its chain decoded greedily")
    rule = rec["draftlab"].get("rule")
    if rule in ("sampled", "mixed"):
        causes.append("different lossless rules, a gap expected by design: draftlab verified sampled drafts with "
                      "their probabilities (accept min(1, p/q)); vLLM drafts greedily by default "
                      "(speculative_config draft_sample_method='greedy': argmax, q one-hot, accept with p(x)). "
                      "Compare like with like: argmax drafts in draftlab (e.g. drafter.sampling=argmax) or "
                      "draft_sample_method='probabilistic' in the server")
    elif rule == "deterministic":
        causes.append("both sides verify argmax drafts by one rule (q one-hot, accept with p(x)), unless the server "
                      "runs draft_sample_method='probabilistic': the gap is not the rule but p or the drafts")
    if rec.get("pattern") in _PATTERN_HINTS:
        causes.append(_PATTERN_HINTS[rec["pattern"]])
    gap, bound = rec["gaps"]["tau"], rec.get("end_bound")
    if bound and gap["gap"] is not None and gap["gap"] > 0 and gap["ci"] and gap["ci"][0] <= bound:
        causes.append(f"up to +{bound:.3f} of the τ gap can be the engine counting the last round's acceptances past "
                      f"max_tokens ({rec['end_hits']} answer(s) hit the limit), which draftlab does not count")
    if greedy is not None:
        par = greedy.get("parity") or {}
        if par.get("flagged") and not par.get("last_round_excess"):
            causes.append("the T=0 check flags this chain too: its checklist first (a convention read differently "
                          "shows at every temperature)")
        elif par.get("ci") is not None:
            causes.append("T=0 agrees, so the export's conventions (aux layers, norm, rope, vocabulary map) are read "
                          "alike: the gap is in sampling")
    return causes or [f"no pattern to go on ({n} prompts): rerun with more prompts or seeds"]


def sampled_compare(served: dict[str, Any], draftlab: dict[str, Any], *, k: int, temperature: float,
                    seeds: list[int], top_p: float | None = None, top_k: int | None = None, resamples: int = 2000,
                    level: float = 0.95, greedy: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chain length's sampled comparison: ``served`` from ``query_seeded``, ``draftlab`` from
    ``draftlab_seeded`` (``counters`` ``[prompt][seed]`` on both; ``tokens``, ``hit`` and ``rule`` when known);
    ``greedy``: the same chain's T = 0 record, whose parity sharpens the hints."""
    boot = cluster_bootstrap(served["counters"], draftlab["counters"], k=k, resamples=resamples, level=level)
    total = {name: sum((c for row in side["counters"] for c in row), SpecCounters())
             for name, side in (("served", served), ("draftlab", draftlab))}
    hits = int(served.get("hit") or 0)
    rec = {"temperature": float(temperature), "top_p": top_p, "top_k": top_k, "seeds": list(seeds),
           "num_speculative_tokens": k, "n_prompts": len(served["counters"]),
           "served": boot["served"] | {"counters": asdict(total["served"]),
                                       "varied": varied(served["tokens"]) if "tokens" in served else None},
           "draftlab": boot["draftlab"] | {"counters": asdict(total["draftlab"]), "rule": draftlab.get("rule"),
                                           "varied": varied(draftlab["tokens"]) if "tokens" in draftlab else None},
           "gaps": boot["gaps"], "test": boot["test"], "end_hits": hits,
           "end_bound": hits * k / total["served"].drafts if total["served"].drafts else None}
    if not (total["served"].drafts and total["draftlab"].drafts):
        return rec | {"verdict": None, "pattern": None,
                      "causes": ["not judged: a side has no draft rounds (does the engine expose its spec-decode "
                                 "counters?)"]}
    gaps = rec["gaps"]
    differ = any(_excludes_zero(e) for e in [gaps["tau"], *gaps["positions"]])
    rec |= {"verdict": "differ" if differ else "agree", "pattern": pattern_of(gaps) if differ else None}
    return rec | {"causes": sampled_causes(rec, greedy) if differ else []}


# -- text, metrics, the stage's part --------------------------------------------------------------------------

def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ci(value: float | None, ci: list[float] | None, spec: str = ".2f") -> str:
    return _f(value, spec) + ("" if ci is None else f" [{ci[0]:{spec}}, {ci[1]:{spec}}]")


def format_sampled(rec: dict[str, Any], engine: str = "vllm") -> str:
    """The sampled comparison as text: both sides with intervals, the gaps, the verdict and its hints."""
    k, n, seeds, t = rec["num_speculative_tokens"], rec["n_prompts"], rec["seeds"], rec["temperature"]
    head = ["", "tau", *(f"acc@{i}" for i in range(k))]
    rows = [head]
    for name, side in ((f"{engine} + draft", rec["served"]), ("draftlab chain", rec["draftlab"])):
        rows.append([name, _ci(side["tau"], side["tau_ci"]),
                     *(_ci(r, c) for r, c in zip(side["position_rates"], side["position_ci"]))])
    g = rec["gaps"]
    rows.append(["gap (served - draftlab)", _ci(g["tau"]["gap"], g["tau"]["ci"], "+.2f"),
                 *(_ci(e["gap"], e["ci"], "+.2f") for e in g["positions"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    trunc = ", ".join(f"{key}={rec[key]}" for key in ("top_p", "top_k") if rec.get(key) is not None)
    rule = rec["draftlab"].get("rule")
    text = [f"Served vs draftlab acceptance at T={t:g}{' (' + trunc + ')' if trunc else ''}: {n} prompts x "
            f"{len(seeds)} seeds, chain of {k}, batch 1 (both sides sample: outputs differ, acceptance compared "
            "as distributions)",
            *lines,
            f"outputs varied across seeds: {engine} {_f(rec['served'].get('varied'), 'd')}/{n} prompts, draftlab "
            f"{_f(rec['draftlab'].get('varied'), 'd')}/{n}; draftlab's rule: {rule or '-'}",
            f"{rec['test']}"]
    if rec["verdict"] is None:
        return "\n".join(text + [f"verdict: {rec['causes'][0]}"])
    if rec["verdict"] == "agree":
        return "\n".join(text + ["verdict: agree within noise (every gap interval contains 0)"])
    return "\n".join(text + [f"verdict: DIFFER ({rec['pattern'] or 'no pattern'}; served "
                             f"{'more' if (g['tau']['gap'] or 0) > 0 else 'less'}). Likely causes to check (a hint "
                             "from the pattern, not a diagnosis):", *(f"  [ ] {c}" for c in rec["causes"])])


def sampled_metrics(entries: list[dict[str, Any]]) -> dict[str, float]:
    """``eval/served/k{k}/t{T}/{tau, draftlab_tau, tau_gap, differ}`` per sampled comparison."""
    out = {}
    for e in entries:
        key = f"eval/served/k{e['num_speculative_tokens']}/t{e['temperature']:g}"
        for name, v in (("tau", e["served"]["tau"]), ("draftlab_tau", e["draftlab"]["tau"]),
                        ("tau_gap", e["gaps"]["tau"]["gap"]),
                        ("differ", None if e["verdict"] is None else float(e["verdict"] == "differ"))):
            if v is not None:
                out[f"{key}/{name}"] = float(v)
    return out


def evaluate_sampled(target, make_drafter, prompts: list[str], seeded: dict[int, dict[str, Any]],
                     greedy: list[dict[str, Any]], sampling: dict[str, Any], *, max_tokens: int, resamples: int,
                     level: float) -> list[dict[str, Any]]:
    """The sampled comparison of every chain length served: draftlab's side run here (``make_drafter(k)``, a
    fresh chain of k), the server's from ``seeded[k]`` (``query_seeded``), the T = 0 records beside."""
    entries = []
    for rec in greedy:
        k = rec["num_speculative_tokens"]
        mine = draftlab_seeded(target, make_drafter(k), prompts, k=k, max_tokens=max_tokens, **sampling)
        entries.append(sampled_compare(seeded[k], mine, k=k, resamples=resamples, level=level, greedy=rec, **sampling))
    return entries
