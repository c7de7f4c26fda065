"""Served evaluation: the exported draft inside a serving engine, beside draftlab's own engine.

A draft can validate well in training and still accept far less once served (a convention the export and the
engine read differently). This measures it where it runs: the target is served twice, plain and with the
exported draft (``--speculative-config {"method": ..., "num_speculative_tokens": k}``), and asked the same
prompts one at a time, greedily (T=0, batch 1, as draftlab decodes). Per prompt it keeps the token ids, tok/s
(completion tokens / request latency) and the engine's own speculative-decoding counters, read from
``/metrics`` before and after the request:

- ``vllm:spec_decode_num_drafts_total`` (draft rounds), ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``;
- τ_served = 1 + accepted / drafts: vLLM's "mean acceptance length" (``v1/spec_decode/metrics.py`` logs exactly
  this), the bonus token included, which is Spec-Bench's τ and ``DecodeStats.tau`` (tokens per round).

The same first turns then go through draftlab's engine with the run's drafter configured as a chain of ``k``
(the method's ``export.serve.chain(k)``, e.g. EAGLE-3 ``top_k=1, depth=k, total_tokens=k``, DFlash
``block_size=k+1``; ``eval.served.chain`` overrides it), giving draftlab's τ and per-position acceptance on the
same prompts and chain length. Which export format an engine reads and what it calls the method come from the
same block (``export.serve.<engine>: {format, method}``), so the stage names no method.

Parity check: a paired bootstrap over prompts (resample prompts with replacement, τ of each side as
1 + Σaccepted / Σdrafts over the resample) gives a CI of τ_served - τ_draftlab; a CI that excludes 0 is
flagged. It is a hint, not a diagnosis: the printed checklist names the usual causes.

``eval.engine=sglang`` launches ``sglang.launch_server`` the same way (a chain: ``--speculative-eagle-topk 1``);
SGLang's metrics have other names, so there only outputs and tok/s come back. Here (no GPU) it fails at once
with the command it would run.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftlab.utils.errors import ConfigError

ENGINES = ("draftlab", "vllm", "sglang")
_PREFIX = "vllm:spec_decode_num_"
_COUNTERS = {"drafts": _PREFIX + "drafts_total", "draft_tokens": _PREFIX + "draft_tokens_total",
             "accepted": _PREFIX + "accepted_tokens_total"}
_PER_POS = _PREFIX + "accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')

# Code defaults of ``eval.served`` (conf/eval.yaml spells the same block, so a train run gets them too).
DEFAULTS: dict[str, Any] = {
    "python": None, "urls": None, "num_speculative_tokens": 3, "prompts": 6, "max_tokens": 64,
    "dtype": "float32", "max_model_len": 2048, "startup_timeout": 1200, "request_timeout": 600,
    "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"},
    "extra": [], "chain": None, "bootstrap": 2000, "level": 0.95,
}

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


def query_server(url: str, prompts: list[str], *, max_tokens: int, model: str, timeout: float = 600.0,
                 settle: float = 0.2) -> tuple[list[ServedAnswer], SpecCounters]:
    """Ask ``prompts`` one at a time (greedy); per prompt its answer and counter delta, plus the run's delta."""
    from draftlab.serving import ChatClient

    client = ChatClient(url, model=model, concurrency=1, timeout=timeout, retries=1,
                        defaults={"temperature": 0.0, "return_token_ids": True})
    start = before = _settled_counters(url, settle)
    answers = []
    for prompt in prompts:
        (done,) = client.chat_many_sync([[{"role": "user", "content": prompt}]], max_tokens=max_tokens)
        after = _settled_counters(url, settle)
        answers.append(ServedAnswer(done.token_ids, done.text, done.prompt_token_ids, done.latency_s,
                                    done.completion_tokens / max(done.latency_s, 1e-9), after - before))
        before = after
    return answers, before - start


@dataclass
class ChainAnswer:
    prompt_ids: list[int]
    token_ids: list[int]
    tps: float
    counters: SpecCounters  # the same counters, counted from draftlab's accept lengths


def chain_counters(accept_lengths: list[int], k: int) -> SpecCounters:
    """draftlab's rounds as vLLM counts them: a round is a draft of k tokens, accept length - 1 accepted."""
    acc = [a - 1 for a in accept_lengths]
    return SpecCounters(float(len(acc)), float(k * len(acc)), float(sum(acc)),
                        tuple(float(sum(a > i for a in acc)) for i in range(k)))


def draftlab_chain(target, drafter, prompts: list[str], *, k: int, max_tokens: int) -> list[ChainAnswer]:
    """The same first turns through draftlab's engine (greedy), one untimed warm-up first."""
    from draftlab.data.template import render_prompt
    from draftlab.decoding.engine import GenerationConfig, speculative_generate

    gen = GenerationConfig(max_new_tokens=max_tokens, temperature=0.0)
    speculative_generate(target, target.tokenizer.encode("Hello"), drafter, GenerationConfig(max_new_tokens=8))
    out = []
    for prompt in prompts:
        ids = render_prompt(target.tokenizer, [{"role": "user", "content": prompt}])
        tokens, stats = speculative_generate(target, ids, drafter, gen)
        out.append(ChainAnswer(ids, list(tokens), stats.new_tokens / max(stats.wall_time, 1e-9),
                               chain_counters(stats.accept_lengths, k)))
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


def compare(plain: list[ServedAnswer], spec: list[ServedAnswer], chain: list[ChainAnswer], *, k: int,
            stop_ids: set[int] = frozenset(), resamples: int = 2000, level: float = 0.95) -> dict[str, Any]:
    """The served-vs-draftlab record: τ and per-position acceptance of both sides, identical outputs, tok/s,
    the parity check."""
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
                        "plain_tps": p.tps} for a, c, p in zip(spec, chain, plain)],
        "parity": asdict(par),
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
    verdict = "GAP beyond noise: check the list below" if par["flagged"] else "no gap beyond noise"
    text = [f"Served vs draftlab tau: {n} prompts, T=0, chain of {k}, batch 1",
            *lines,
            f"{engine} + draft outputs identical to {engine} plain: {rec['identical_to_plain']}/{n}; "
            f"same tokens as draftlab: {rec['same_tokens_as_draftlab']}/{n}; same prompt ids: {rec['same_prompt_ids']}/{n}",
            f"parity: tau_served - tau_draftlab = {_fmt(par['gap'], '+.3f')} {ci} ({par['test']}): {verdict}"]
    if par["flagged"]:
        text += ["Likely causes to check (a hint from two numbers, not a diagnosis):",
                 *(f"  [ ] {c}" for c in CHECKLIST)]
    return "\n".join(text)


# -- the stage side: settings, servers, export ----------------------------------------------------------------

def serve_plan(cfg: DictConfig, engine: str) -> dict[str, str]:
    """The method's ``export.serve.<engine>``: ``{format, method}`` (the export format the engine reads and the
    engine's name for the method)."""
    name = cfg.method.get("name", "?")
    plan = OmegaConf.select(cfg.method, f"export.serve.{engine}")
    if plan is None or not {"format", "method"} <= set(plan):
        raise ConfigError(f"method '{name}' declares no way for {engine} to serve its draft "
                          f"(export.serve.{engine}: {{format, method}} in conf/method/{name}.yaml)",
                          field="eval.engine")
    return {"format": str(plan.format), "method": str(plan.method)}


def _method_chain(cfg: DictConfig, k: int) -> dict[str, Any] | None:
    from hydra.utils import instantiate

    node = OmegaConf.select(cfg.method, "export.serve.chain")
    return dict(instantiate(node)(k)) if node is not None else None


def served_settings(cfg: DictConfig) -> dict[str, Any]:
    """``eval.served`` over ``DEFAULTS``; the chain defaults to the method's chain of ``num_speculative_tokens``."""
    block = cfg.eval.get("served")
    given = OmegaConf.to_container(block, resolve=True) if block is not None else {}
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}", field="eval.served")
    s = {**DEFAULTS, **given}
    s["chain"] = dict(given.get("chain") or _method_chain(cfg, int(s["num_speculative_tokens"])) or {})
    return s


def check_engine(cfg: DictConfig) -> str:
    engine = str(cfg.eval.get("engine", "draftlab"))
    if engine not in ENGINES:
        raise ConfigError(f"expected one of {', '.join(ENGINES)}, got {engine!r}", field="eval.engine")
    if engine != "draftlab":
        served_settings(cfg)  # an unknown eval.served key, or a method no engine serves, fails now, not after training
        serve_plan(cfg, engine)
    return engine


def chain_drafter(cfg: DictConfig, draft, chain: dict[str, Any]):
    """The run's drafter with the ``chain`` knobs that its drafter block has (the rest are reported)."""
    from draftlab.methods.registry import MethodSpec

    method = OmegaConf.create(OmegaConf.to_container(cfg.method, resolve=False))
    knobs = method.get("drafter") or {}
    if not chain:
        raise ConfigError(f"method '{method.name}' declares no served chain (export.serve.chain); set "
                          "eval.served.chain to the drafter knobs that make a chain of k tokens", field="eval.served.chain")
    missing = [key for key in chain if key not in knobs]
    if missing:
        raise ConfigError(f"method '{method.name}' drafter has no {missing}: cannot configure it as a chain "
                          "(set eval.served.chain to its knobs)", field="eval.served.chain")
    for key, value in chain.items():
        method.drafter[key] = value
    return MethodSpec(method).build_drafter(draft)


def require_engine(engine: str, s: dict[str, Any], model: str, draft_dir: Path, method: str) -> None:
    """Fail before exporting when the engine's python cannot import it (SGLang: no GPU here), naming the
    command that would have run."""
    python = s["python"] or sys.executable
    if s["urls"] or subprocess.run([python, "-c", f"import {engine}"], capture_output=True).returncode == 0:
        return
    cmd = _server(engine, model, s, draft_dir, method, Path("server.log")).cmd
    raise ConfigError(f"eval.engine={engine}: {engine} is not importable by {python}; set eval.served.python to "
                      f"the interpreter of an environment that has it{' (SGLang needs a GPU)' * (engine == 'sglang')}"
                      f", or eval.served.urls to running servers. It would run: {' '.join(cmd)}", field="eval.engine")


def _server(engine: str, model: str, s: dict[str, Any], draft_dir: Path | None, method: str, log: Path):
    from draftlab.serving import (
        SGLANG_HEALTH,
        VLLM_HEALTH,
        ServerProcess,
        free_port,
        sglang_command,
        vllm_command,
    )

    port, k, python = free_port(), int(s["num_speculative_tokens"]), s["python"] or sys.executable
    if engine == "vllm":
        spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": k} if draft_dir else None
        cmd = vllm_command(model, port=port, dtype=s["dtype"], max_model_len=s["max_model_len"],
                           served_model_name="target", speculative_config=spec, python=python, extra=s["extra"])
        health = VLLM_HEALTH
    else:
        cmd = sglang_command(model, port=port, dtype=s["dtype"], draft_model_path=draft_dir, algorithm=method,
                             num_steps=k, eagle_topk=1, num_draft_tokens=k + 1, served_model_name="target",
                             python=python, extra=s["extra"])
        health = SGLANG_HEALTH
    return ServerProcess(cmd, port=port, health_paths=health, startup_timeout=float(s["startup_timeout"]),
                         log_path=log, env={k_: str(v) for k_, v in (s["env"] or {}).items()})


def _serve_both(engine: str, model: str, s: dict[str, Any], draft_dir: Path | None, method: str, out: Path,
                prompts: list[str]) -> tuple[list[ServedAnswer], list[ServedAnswer]]:
    """(plain answers, answers with the draft): from ``eval.served.urls`` or two launches, one at a time."""
    ask = dict(max_tokens=int(s["max_tokens"]), model="target", timeout=float(s["request_timeout"]))
    urls = s["urls"]
    if urls:
        if set(urls) != {"plain", "spec"}:
            raise ConfigError("expected {plain: URL, spec: URL}", field="eval.served.urls")
        return query_server(urls["plain"], prompts, **ask)[0], query_server(urls["spec"], prompts, **ask)[0]
    answers = []
    for name, draft in (("plain", None), ("spec", draft_dir)):
        with _server(engine, model, s, draft, method, out / f"{engine}_{name}.log") as server:
            answers.append(query_server(server.url, prompts, **ask)[0])
    return answers[0], answers[1]


def served_evaluate(cfg: DictConfig, target, draft, draft_dir: Path | None, run_dir: Path
                    ) -> tuple[dict[str, Any], dict[str, float]]:
    """``eval.engine=vllm|sglang``: export the run's draft, serve it, compare with draftlab's chain."""
    from hydra.utils import instantiate

    from draftlab.export import export_checkpoint
    from draftlab.methods.registry import MethodSpec
    from draftlab.utils.atomic import atomic_write_text

    engine, s = check_engine(cfg), served_settings(cfg)
    spec, plan = MethodSpec(cfg.method), serve_plan(cfg, engine)
    if draft is None or draft_dir is None:
        raise ConfigError(f"eval.engine={engine} serves a trained draft; method '{spec.name}' has none",
                          field="eval.engine")
    out = Path(run_dir) / "served"
    out.mkdir(parents=True, exist_ok=True)
    bench = instantiate(cfg.bench, _convert_="object")
    prompts = [q.turns[0] for q in bench.load(tokenizer=target.tokenizer)[: int(s["prompts"])]]
    model = str(getattr(target.model.config, "_name_or_path", "") or target.name)
    export_dir = None
    require_engine(engine, s, model, out / f"draft_{engine}", plan["method"])
    if not s["urls"]:
        fmt = plan["format"]
        export_dir = export_checkpoint(spec, draft_dir, out / f"draft_{engine}", format=fmt, target=target)[fmt]
    plain, served = _serve_both(engine, model, s, export_dir, plan["method"], out, prompts)
    k = int(s["num_speculative_tokens"])
    chain = draftlab_chain(target, chain_drafter(cfg, draft, s["chain"]), prompts, k=k, max_tokens=int(s["max_tokens"]))
    rec = compare(plain, served, chain, k=k, stop_ids=set(target.eos_token_ids), resamples=int(s["bootstrap"]),
                  level=float(s["level"]))
    rec |= {"engine": engine, "bench": bench.name, "max_tokens": int(s["max_tokens"]), "chain": s["chain"],
            "export": str(export_dir) if export_dir else None, "urls": s["urls"]}
    text = format_served(rec, engine)
    print(text)
    atomic_write_text(Path(run_dir) / "served_comparison.txt", text + "\n")
    metrics = {f"eval/served/{key}": float(v) for key, v in (("tau", rec["served"]["tau"]),
               ("draftlab_tau", rec["draftlab"]["tau"]), ("identical_to_plain", rec["identical_to_plain"]),
               ("parity_flagged", rec["parity"]["flagged"])) if v is not None}
    record = {"bench": bench.name, "method": spec.name, "label": spec.label, "engine": engine, "temperature": 0.0,
              "max_new_tokens": int(s["max_tokens"]), "served": rec}
    return record, metrics
