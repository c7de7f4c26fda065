"""What a served evaluation measures and how it compares: the engine's speculative-decoding counters, answers
asked one at a time, draftlab's chain counted the same way, the paired-bootstrap parity check, the tables.

- ``vllm:spec_decode_num_drafts_total`` (draft rounds), ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``;
- τ_served = 1 + accepted / drafts: vLLM's "mean acceptance length" (``v1/spec_decode/metrics.py`` logs exactly
  this), the bonus token included, which is Spec-Bench's τ and ``DecodeStats.tau`` (tokens per round).

Speed-ups are ratios of aggregate tok/s (Σ new tokens / Σ seconds over the prompts) measured side by side:
served with the draft over served plain, draftlab's chain over draftlab's AR on the same prompts.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

_PREFIX = "vllm:spec_decode_num_"
_COUNTERS = {"drafts": _PREFIX + "drafts_total", "draft_tokens": _PREFIX + "draft_tokens_total",
             "accepted": _PREFIX + "accepted_tokens_total"}
_PER_POS = _PREFIX + "accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')
CHECKLIST = (
    "aux layer ids: the export's eagle_aux_hidden_state_layer_ids vs the layers draftlab tapped "
    "(output_of vs input_of convention: off by one?)",
    "final norm: does the engine apply the draft's norm before its lm_head, as training did (norm_output)?",
    "rope: rope_theta / rope_scaling and max_position_embeddings in the export's config vs the target's",
    "vocabulary map: d2t / t2d present, offsets (d2t) vs ids, draft_vocab_size, and which lm_head / embedding "
    "the engine uses (its own or the target's)",
    "max length: --max-model-len and the draft's max_position_embeddings vs the prompt + answer lengths",
    "prompts: the same chat template and system prompt (compare the prompt ids above)",
    "dtype: both sides in the same precision (a bf16 server drifts from an fp32 reference)",
)


@dataclass(frozen=True)
class SpecCounters:
    """The engine's cumulative speculative-decoding counters (or a difference of two readings)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()

    def _combine(self, other: SpecCounters, sign: float) -> SpecCounters:
        n = max(len(self.per_pos), len(other.per_pos))
        pad = lambda p: tuple(p) + (0.0,) * (n - len(p))  # noqa: E731
        return SpecCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                            self.accepted + sign * other.accepted,
                            tuple(a + sign * b for a, b in zip(pad(self.per_pos), pad(other.per_pos))))

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1.0)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1.0)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length, vLLM's convention: 1 + accepted / drafts (None without drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def position_rates(self) -> list[float]:
        """Accepted at draft position i / drafts: the share of rounds that got past position i."""
        return [p / self.drafts for p in self.per_pos] if self.drafts else []


def parse_spec_counters(text: str) -> SpecCounters:
    """The counters in a Prometheus ``/metrics`` page (summed over label sets, e.g. several engines)."""
    totals = dict.fromkeys(_COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    names = {v: k for k, v in _COUNTERS.items()}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:  # comments (# HELP / # TYPE) and blank lines
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in names:
            totals[names[name]] += value
        elif name == _PER_POS and (pos := _POSITION.search(labels)):
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    return SpecCounters(**totals, per_pos=tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)))


def read_spec_counters(url: str, timeout: float = 10.0) -> SpecCounters:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        return parse_spec_counters(resp.read().decode(errors="replace"))


def _settled_counters(url: str, settle: float) -> SpecCounters:
    """A reading that no longer moves: the engine may record a step's stats just after answering."""
    last = read_spec_counters(url)
    for _ in range(10):
        time.sleep(settle)
        now = read_spec_counters(url)
        if now == last:
            return now
        last = now
    return last


@dataclass
class ServedAnswer:
    token_ids: list[int] | None
    text: str
    prompt_token_ids: list[int] | None
    latency_s: float
    tps: float
    counters: SpecCounters = field(default_factory=SpecCounters)
    new_tokens: int = 0


def query_server(url: str, prompts: list[str], *, max_tokens: int, model: str, timeout: float = 600.0,
                 settle: float = 0.2, desc: str = "served", params: dict[str, Any] | None = None
                 ) -> tuple[list[ServedAnswer], SpecCounters]:
    """Ask ``prompts`` one at a time (greedy unless ``params``, request fields over the greedy defaults, say
    otherwise: e.g. ``temperature`` and ``seed``); per prompt its answer and counter delta, plus the run's delta.
    ``desc`` names the progress bar."""
    from tqdm.auto import tqdm

    from draftlab.serving import ChatClient

    client = ChatClient(url, model=model, concurrency=1, timeout=timeout, retries=1,
                        defaults={"temperature": 0.0, "return_token_ids": True})
    start = before = _settled_counters(url, settle)
    answers = []
    for prompt in tqdm(prompts, desc=desc, unit="prompt"):
        (done,) = client.chat_many_sync([[{"role": "user", "content": prompt}]], max_tokens=max_tokens,
                                        **(params or {}))
        after = _settled_counters(url, settle)
        answers.append(ServedAnswer(done.token_ids, done.text, done.prompt_token_ids, done.latency_s,
                                    done.completion_tokens / max(done.latency_s, 1e-9), after - before,
                                    int(done.completion_tokens)))
        before = after
    return answers, before - start


@dataclass
class ChainAnswer:
    prompt_ids: list[int]
    token_ids: list[int]
    tps: float
    counters: SpecCounters  # the same counters, counted from draftlab's accept lengths
    seconds: float = 0.0


def chain_counters(accept_lengths: list[int], k: int) -> SpecCounters:
    """draftlab's rounds as vLLM counts them: a round is a draft of k tokens, accept length - 1 accepted."""
    acc = [a - 1 for a in accept_lengths]
    return SpecCounters(float(len(acc)), float(k * len(acc)), float(sum(acc)),
                        tuple(float(sum(a > i for a in acc)) for i in range(k)))


def draftlab_chain(target, drafter, prompts: list[str], *, k: int, max_tokens: int) -> list[ChainAnswer]:
    """The same first turns through draftlab's engine (greedy), one untimed warm-up first; ``drafter=None`` is
    draftlab's AR (the reference of its speed-up; ``k`` is then 0)."""
    from tqdm.auto import tqdm

    from draftlab.data.template import render_prompt
    from draftlab.decoding.engine import GenerationConfig, speculative_generate

    gen = GenerationConfig(max_new_tokens=max_tokens, temperature=0.0)
    out = []
    try:
        speculative_generate(target, target.tokenizer.encode("Hello"), drafter, GenerationConfig(max_new_tokens=8))
        for prompt in tqdm(prompts, desc="draftlab AR" if drafter is None else f"draftlab chain k={k}", unit="prompt"):
            ids = render_prompt(target.tokenizer, [{"role": "user", "content": prompt}])
            tokens, stats = speculative_generate(target, ids, drafter, gen)
            out.append(ChainAnswer(ids, list(tokens), stats.new_tokens / max(stats.wall_time, 1e-9),
                                   chain_counters(stats.accept_lengths, k) if drafter is not None else SpecCounters(),
                                   float(stats.wall_time)))
    finally:
        if drafter is not None:
            drafter.close()  # the drafter is this function's: whatever it holds ends here
    return out


@dataclass
class Parity:
    served_tau: float | None
    draftlab_tau: float | None
    gap: float | None
    ci: tuple[float, float] | None
    flagged: bool
    test: str


def parity_check(served: list[SpecCounters], draftlab: list[SpecCounters], *, resamples: int = 2000,
                 level: float = 0.95, seed: int = 0) -> Parity:
    """τ_served - τ_draftlab with a paired bootstrap CI over prompts; flagged when the CI excludes 0."""
    if len(served) != len(draftlab):
        raise ValueError(f"paired prompts needed: {len(served)} served vs {len(draftlab)} draftlab")
    test = f"paired bootstrap over {len(served)} prompts, {resamples} resamples, {level:.0%} CI"

    def tau(counters: list[SpecCounters]) -> float | None:
        drafts = sum(c.drafts for c in counters)
        return 1.0 + sum(c.accepted for c in counters) / drafts if drafts else None

    ts, td = tau(served), tau(draftlab)
    if ts is None or td is None:
        return Parity(ts, td, None, None, False, test + " (not run: a side has no drafts)")
    rng, n, gaps = random.Random(seed), len(served), []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        a, b = tau([served[i] for i in idx]), tau([draftlab[i] for i in idx])
        if a is not None and b is not None:
            gaps.append(a - b)
    gaps.sort()
    lo = gaps[int((1 - level) / 2 * (len(gaps) - 1))]
    hi = gaps[int((1 + level) / 2 * (len(gaps) - 1))]
    return Parity(ts, td, ts - td, (lo, hi), not lo <= 0.0 <= hi, test)


def _strip_stop(ids: list[int] | None, stop: set[int]) -> list[int] | None:
    if ids is None:
        return None
    ids = list(ids)
    while ids and ids[-1] in stop:
        ids.pop()
    return ids


def _aggregate_tps(tokens: list[int], seconds: list[float]) -> float | None:
    return sum(tokens) / sum(seconds) if seconds and sum(seconds) > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedups(plain: list[ServedAnswer], spec: list[ServedAnswer], chain: list[ChainAnswer],
             ar: list[ChainAnswer] | None) -> dict[str, float | None]:
    """Aggregate tok/s (Σ tokens / Σ seconds) of each side and the two speed-ups measured side by side:
    served draft over served plain, draftlab chain over draftlab AR (None without an AR run)."""
    agg = lambda xs: _aggregate_tps([a.new_tokens for a in xs], [a.latency_s for a in xs])  # noqa: E731
    dl = lambda xs: _aggregate_tps([len(c.token_ids) for c in xs], [c.seconds for c in xs]) if xs else None  # noqa: E731
    out = {"served_tps": agg(spec), "plain_tps": agg(plain), "draftlab_tps": dl(chain), "ar_tps": dl(ar)}
    return out | {"served_speedup": _ratio(out["served_tps"], out["plain_tps"]),
                  "draftlab_speedup": _ratio(out["draftlab_tps"], out["ar_tps"])}


def last_round_excess(spec: list[ServedAnswer], chain: list[ChainAnswer], *, k: int,
                      max_tokens: int | None) -> dict[str, int] | None:
    """Whether every per-prompt difference is the engine counting the last round's acceptances past
    ``max_tokens``: vLLM records a round's accepted drafts before the length limit cuts the output, draftlab
    counts only tokens it keeps. Then the rounds agree, the engine has 1..k more accepted, and only on prompts
    whose output reached ``max_tokens``. ``{prompts, tokens}`` when so, ``None`` when any difference is not."""
    if max_tokens is None:
        return None
    prompts = tokens = 0
    for a, c in zip(spec, chain):
        extra = a.counters.accepted - c.counters.accepted
        if extra == 0 and a.counters.drafts == c.counters.drafts:
            continue
        if a.counters.drafts != c.counters.drafts or not 0 < extra <= k or len(c.token_ids) < max_tokens:
            return None
        prompts, tokens = prompts + 1, tokens + int(extra)
    return {"prompts": prompts, "tokens": tokens} if prompts else None


def compare(plain: list[ServedAnswer], spec: list[ServedAnswer], chain: list[ChainAnswer], *, k: int,
            stop_ids: set[int] = frozenset(), resamples: int = 2000, level: float = 0.95,
            ar: list[ChainAnswer] | None = None, max_tokens: int | None = None) -> dict[str, Any]:
    """The served-vs-draftlab record: τ and per-position acceptance of both sides, identical outputs, tok/s and
    speed-ups, the parity check."""
    def same(a: ServedAnswer, b: ServedAnswer) -> bool:
        return a.token_ids == b.token_ids if a.token_ids is not None and b.token_ids is not None else a.text == b.text

    served_run = sum((a.counters for a in spec), SpecCounters())
    chain_run = sum((c.counters for c in chain), SpecCounters())
    par = parity_check([a.counters for a in spec], [c.counters for c in chain], resamples=resamples, level=level)
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "n_prompts": len(spec), "num_speculative_tokens": k,
        "served": {"tau": served_run.tau, "position_rates": served_run.position_rates, "counters": asdict(served_run),
                   "tps": mean([a.tps for a in spec]), "plain_tps": mean([a.tps for a in plain])},
        "draftlab": {"tau": chain_run.tau, "position_rates": chain_run.position_rates,
                     "counters": asdict(chain_run), "tps": mean([c.tps for c in chain])},
        "identical_to_plain": sum(same(a, b) for a, b in zip(spec, plain)),
        "same_tokens_as_draftlab": sum(_strip_stop(a.token_ids, stop_ids) == _strip_stop(c.token_ids, stop_ids)
                                       for a, c in zip(spec, chain)),
        "same_prompt_ids": sum(a.prompt_token_ids == c.prompt_ids for a, c in zip(spec, chain)),
        "per_prompt": [{"served_tau": a.counters.tau, "draftlab_tau": c.counters.tau, "served_tps": a.tps,
                        "plain_tps": p.tps, "served_acceptance": a.counters.position_rates,
                        "draftlab_acceptance": c.counters.position_rates} for a, c, p in zip(spec, chain, plain)],
        "parity": asdict(par) | {"last_round_excess": last_round_excess(spec, chain, k=k, max_tokens=max_tokens)},
        "speed": speedups(plain, spec, chain, ar),
    }


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_served(rec: dict[str, Any], engine: str = "vllm") -> str:
    k, n = rec["num_speculative_tokens"], rec["n_prompts"]
    head = ["", "tau", *(f"acc@{i}" for i in range(k)), "tok/s"]
    rows = [head, [f"{engine} plain", "-", *("-" * k), _fmt(rec["served"]["plain_tps"], ".1f")]]
    for name, side in ((f"{engine} + draft", rec["served"]), ("draftlab chain", rec["draftlab"])):
        rates = list(side["position_rates"]) + [None] * k
        rows.append([name, _fmt(side["tau"]), *(_fmt(r) for r in rates[:k]), _fmt(side["tps"], ".1f")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    par = rec["parity"]
    ci = "-" if par["ci"] is None else f"[{par['ci'][0]:+.2f}, {par['ci'][1]:+.2f}]"
    excess = par.get("last_round_excess")
    verdict = "GAP beyond noise: check the list below" if par["flagged"] else "no gap beyond noise"
    if par["flagged"] and excess:
        verdict = (f"a gap, all of it {excess['tokens']} token(s) accepted past max_tokens in the last round of "
                   f"{excess['prompts']} prompt(s), which the engine counts and draftlab does not: no convention gap")
    text = [f"Served vs draftlab tau: {n} prompts, T=0, chain of {k}, batch 1",
            *lines,
            f"{engine} + draft outputs identical to {engine} plain: {rec['identical_to_plain']}/{n}; "
            f"same tokens as draftlab: {rec['same_tokens_as_draftlab']}/{n}; same prompt ids: {rec['same_prompt_ids']}/{n}",
            f"parity: tau_served - tau_draftlab = {_fmt(par['gap'], '+.3f')} {ci} ({par['test']}): {verdict}"]
    if par["flagged"] and not excess:
        text += ["Likely causes to check (a hint from two numbers, not a diagnosis):",
                 *(f"  [ ] {c}" for c in CHECKLIST)]
    return "\n".join(text)


def format_chains(recs: list[dict[str, Any]], engine: str = "vllm") -> str:
    """One line per chain length: served τ beside draftlab's τ with the parity interval, identical outputs and
    the two speed-ups (served draft / served plain; draftlab chain / draftlab AR)."""
    head = ["k", f"{engine} tau", "draftlab tau", "gap [95% CI]", "identical", "same as draftlab",
            f"{engine} SR", "draftlab SR"]
    rows = [head]
    for r in recs:
        par, sp, n = r["parity"], r.get("speed") or {}, r["n_prompts"]
        ci = "-" if par["ci"] is None else f"{par['gap']:+.3f} [{par['ci'][0]:+.2f}, {par['ci'][1]:+.2f}]"
        rows.append([str(r["num_speculative_tokens"]), _fmt(r["served"]["tau"]), _fmt(r["draftlab"]["tau"]),
                     ci + ((" end" if par.get("last_round_excess") else " GAP") if par["flagged"] else ""), f"{r['identical_to_plain']}/{n}",
                     f"{r['same_tokens_as_draftlab']}/{n}", _fmt(sp.get("served_speedup")),
                     _fmt(sp.get("draftlab_speedup"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
