"""Served evaluation: the exported draft inside a serving engine, beside draftlab's own engine.

A draft can validate well in training and still accept far less once served (a convention the export and the
engine read differently). This measures it where it runs: the target is served twice, plain and with the
exported draft (``--speculative-config {"method": ..., "num_speculative_tokens": k}``), and asked the same
prompts one at a time, greedily (T=0, batch 1, as draftlab decodes). Per prompt it keeps the token ids, tok/s
(completion tokens / request latency) and the engine's own speculative-decoding counters, read from
``/metrics`` before and after the request (``served_metrics``: τ_served = 1 + accepted / drafts, vLLM's
"mean acceptance length"). ``num_speculative_tokens`` may be a list: the plain server is asked once, then one
launch per chain length.

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

``eval.temperature > 0`` adds a sampled comparison (``served_sampling``) on the same servers: each prompt asked
with ``eval.served.seeds`` seeds on both sides, acceptance compared as distributions (cluster bootstrap over
prompts), recorded as ``served_sampled``. The T = 0 comparison above runs as well: it is the exact one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftlab.eval.served_metrics import (
    ServedAnswer,
    compare,
    draftlab_chain,
    format_chains,
    format_served,
    query_server,
)
from draftlab.eval.served_sampling import (
    DEFAULT_SEEDS,
    evaluate_sampled,
    format_sampled,
    query_seeded,
    sampled_metrics,
    sampling_settings,
    seed_list,
)
from draftlab.utils.errors import ConfigError

ENGINES = ("draftlab", "vllm", "sglang")
DEFAULTS: dict[str, Any] = {
    "python": None, "urls": None, "num_speculative_tokens": 3, "prompts": 6, "max_tokens": 64,
    "dtype": "float32", "max_model_len": 2048, "startup_timeout": 1200, "request_timeout": 600,
    "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"},
    "extra": [], "chain": None, "bootstrap": 2000, "level": 0.95, "seeds": DEFAULT_SEEDS,
}


# -- settings: settings, servers, export ----------------------------------------------------------------

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


def chain_lengths(s: dict[str, Any]) -> list[int]:
    """``num_speculative_tokens``: one chain length or a list of them (one served launch each, one plain)."""
    ks = s["num_speculative_tokens"]
    ks = list(ks) if isinstance(ks, list | tuple) else [ks]
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise ConfigError(f"expected a positive int or a list of them, got {s['num_speculative_tokens']!r}",
                          field="eval.served.num_speculative_tokens")
    return ks


def served_settings(cfg: DictConfig) -> dict[str, Any]:
    """``eval.served`` over ``DEFAULTS``; ``chains`` maps each chain length k to the drafter knobs of a chain of k
    (the method's ``export.serve.chain(k)``, or ``eval.served.chain`` when one length is asked)."""
    block = cfg.eval.get("served")
    given = OmegaConf.to_container(block, resolve=True) if block is not None else {}
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}", field="eval.served")
    s = {**DEFAULTS, **given}
    ks = chain_lengths(s)
    s["seeds"] = seed_list(s["seeds"])
    if given.get("chain") and len(ks) > 1:
        raise ConfigError("one chain's knobs cannot make chains of several lengths: drop eval.served.chain (the "
                          "method's export.serve.chain makes each) or ask one length", field="eval.served.chain")
    s["chains"] = {k: dict(given.get("chain") or _method_chain(cfg, k) or {}) for k in ks}
    s["chain"] = s["chains"][ks[0]] if len(ks) == 1 else None
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


def _server(engine: str, model: str, s: dict[str, Any], draft_dir: Path | None, method: str, log: Path,
            k: int | None = None):
    from draftlab.serving import (
        SGLANG_HEALTH,
        VLLM_HEALTH,
        ServerProcess,
        free_port,
        sglang_command,
        vllm_command,
    )

    port, python = free_port(), s["python"] or sys.executable
    k = chain_lengths(s)[0] if k is None else k
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


def _serve_all(engine: str, model: str, s: dict[str, Any], draft_dir: Path | None, method: str, out: Path,
               prompts: list[str], sampling: dict[str, Any] | None = None
               ) -> tuple[list[ServedAnswer], dict[int, list[ServedAnswer]], dict[int, dict[str, Any]]]:
    """(plain answers, {k: answers with the draft as a chain of k}, {k: seeded sampled answers, with
    ``sampling``}): from ``eval.served.urls`` (one k) or one launch at a time (plain, then one per chain length)."""
    ask = dict(max_tokens=int(s["max_tokens"]), model="target", timeout=float(s["request_timeout"]))
    urls, ks, seeded = s["urls"], chain_lengths(s), {}

    def sampled(url: str, k: int) -> None:  # on the same server, while it runs: a launch costs minutes
        if sampling:
            seeded[k] = query_seeded(url, prompts, desc=f"{engine} k={k}", **sampling, **ask)

    if urls:
        if set(urls) != {"plain", "spec"} or len(ks) != 1:
            raise ConfigError("expected {plain: URL, spec: URL} and one num_speculative_tokens", field="eval.served.urls")
        plain = query_server(urls["plain"], prompts, desc=f"{engine} plain", **ask)[0]
        spec = {ks[0]: query_server(urls["spec"], prompts, desc=f"{engine} k={ks[0]}", **ask)[0]}
        sampled(urls["spec"], ks[0])
        return plain, spec, seeded
    with _server(engine, model, s, None, method, out / f"{engine}_plain.log") as server:
        plain = query_server(server.url, prompts, desc=f"{engine} plain", **ask)[0]
    spec = {}
    for k in ks:
        with _server(engine, model, s, draft_dir, method, out / f"{engine}_spec_k{k}.log", k=k) as server:
            spec[k] = query_server(server.url, prompts, desc=f"{engine} k={k}", **ask)[0]
            sampled(server.url, k)
    return plain, spec, seeded


def _prompts(cfg: DictConfig, s: dict[str, Any], tokenizer) -> tuple[str, list[str]]:
    """The bench's first turns: the first ``eval.served.prompts`` questions (null: all the bench loads)."""
    from hydra.utils import instantiate

    bench = instantiate(cfg.bench, _convert_="object")
    questions = bench.load(tokenizer=tokenizer)
    n = s["prompts"]
    return bench.name, [q.turns[0] for q in (questions if n is None else questions[: int(n)])]


def served_evaluate(cfg: DictConfig, target, artifact, run_dir: Path, spec
                    ) -> tuple[dict[str, Any], dict[str, float]]:
    """``eval.engine=vllm|sglang``: export the run's draft (``artifact``, a ``methods.artifact.DraftArtifact``;
    the exporters read its directory, as ``draftlab-export`` does), serve it, compare with draftlab's chain of
    each length."""
    from draftlab.export import export_checkpoint
    from draftlab.utils.atomic import atomic_write_text

    engine, s = check_engine(cfg), served_settings(cfg)
    plan = serve_plan(cfg, engine)
    draft, draft_dir = (artifact.draft, artifact.dir) if artifact is not None else (None, None)
    if draft is None:
        raise ConfigError(f"eval.engine={engine} serves a trained draft; method '{spec.name}' has none",
                          field="eval.engine")
    out = Path(run_dir) / "served"
    out.mkdir(parents=True, exist_ok=True)
    bench, prompts = _prompts(cfg, s, target.tokenizer)
    model = str(getattr(target.model.config, "_name_or_path", "") or target.name)
    export_dir = None
    require_engine(engine, s, model, out / f"draft_{engine}", plan["method"])
    if not s["urls"]:
        fmt = plan["format"]
        export_dir = export_checkpoint(spec, draft_dir, out / f"draft_{engine}", format=fmt, target=target)[fmt]
    sampling = sampling_settings(cfg.eval, s)  # None at T = 0: the greedy comparison alone, as before
    plain, served, seeded = _serve_all(engine, model, s, export_dir, plan["method"], out, prompts, sampling)
    max_tokens = int(s["max_tokens"])
    ar = draftlab_chain(target, None, prompts, k=0, max_tokens=max_tokens)  # draftlab's AR: its speed-up's reference
    recs = []
    for k, answers in served.items():
        chain = draftlab_chain(target, chain_drafter(cfg, draft, s["chains"][k]), prompts, k=k, max_tokens=max_tokens)
        recs.append(compare(plain, answers, chain, k=k, stop_ids=set(target.eos_token_ids), ar=ar, max_tokens=max_tokens,
                            resamples=int(s["bootstrap"]), level=float(s["level"]))
                    | {"engine": engine, "bench": bench, "max_tokens": max_tokens, "chain": s["chains"][k],
                       "export": str(export_dir) if export_dir else None, "urls": s["urls"]})
    sampled = evaluate_sampled(target, lambda k: chain_drafter(cfg, draft, s["chains"][k]), prompts, seeded, recs,
                               sampling, max_tokens=max_tokens, resamples=int(s["bootstrap"]),
                               level=float(s["level"])) if sampling else []
    text = "\n\n".join([format_served(r, engine) for r in recs]
                        + ([f"Chains {', '.join(str(r['num_speculative_tokens']) for r in recs)}:\n"
                            + format_chains(recs, engine)] if len(recs) > 1 else [])
                        + [format_sampled(e, engine) for e in sampled])
    print(text)
    atomic_write_text(Path(run_dir) / "served_comparison.txt", text + "\n")
    metrics = {f"eval/served/k{r['num_speculative_tokens']}/{key}": float(v) for r in recs
               for key, v in (("tau", r["served"]["tau"]), ("draftlab_tau", r["draftlab"]["tau"]),
                              ("identical_to_plain", r["identical_to_plain"]), ("parity_flagged", r["parity"]["flagged"]),
                              ("speedup", r["speed"]["served_speedup"]), ("draftlab_speedup", r["speed"]["draftlab_speedup"]))
               if v is not None} | sampled_metrics(sampled)
    # "temperature" is the served list's (greedy); each served_sampled entry carries its own
    record = {"bench": bench, "method": spec.name, "label": spec.label, "engine": engine, "temperature": 0.0,
              "axes": spec.axes(artifact.trained_config), "max_new_tokens": max_tokens, "served": recs}
    return (record | {"served_sampled": sampled} if sampling else record), metrics
