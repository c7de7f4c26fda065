"""Served throughput at concurrency 1 / 4 / 16, with and without a draft, in vLLM: output tok/s, τ and the
speed-up per level (``draftlab.eval.served_load``).

Run with draftlab's interpreter from the repository root; the servers run with vLLM's (``--python``):

    python experiments/serving/concurrency.py --method eagle3 --draft DRAFT_DIR --python /work/vllm-venv/bin/python \
        --num-speculative-tokens 3 --levels 1 4 16 --repeats 3 --enforce-eager --name quickstart_eagle3

The draft is exported as ``draftlab-eval eval.engine=vllm`` exports it (the method's ``export.serve.vllm`` plan),
or ``--export DIR`` names an existing vLLM export. The target is served plain, then once per chain length with
``--speculative-config``; each server answers the Spec-Bench first turns (``--per-category`` questions of each
category) at every level, after an untimed warm-up. ``--plain-url`` / ``--draft-url`` measure servers already
running instead (one chain length).

The record (``experiments/serving/records/concurrency_<name>.json``, a ``draftlab.record/1`` eval record whose
``eval.concurrency`` block is described in ``analysis/served_concurrency.py``) is written after every level and
names the commit, whether the tree was dirty, the machine and every setting. A rerun skips the (server, level)
pairs it holds, so an interrupted sweep resumes; it refuses a record made under other settings (``--fresh``
starts over). The Markdown table is written beside it (``.md``) and printed; ``draftlab-table RECORD --layout
served`` prints it again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from draftlab import tracking
from draftlab.eval import served_load
from draftlab.utils.atomic import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "experiments" / "serving" / "records"
# Settings that change what a level measures: a record holding levels measured under other values is not resumed
# (new levels or chain lengths are added to it; those are keys of its own).
MEASURE_KEYS = ("method", "model", "draft", "export", "bench", "per_category", "prompts", "prompts_sha256",
                "max_tokens", "temperature", "dtype", "max_model_len", "server_args", "kv_cache_gib", "repeats",
                "urls")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="eagle3", help="conf/method/<name>.yaml of the draft")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--draft", type=Path, help="a trained draft (the artifact's draft/ directory), exported here")
    src.add_argument("--export", type=Path, help="an existing vLLM export of the draft (no export step)")
    p.add_argument("--python", default=os.environ.get("DRAFTLAB_VLLM_PYTHON", sys.executable),
                   help="vLLM's interpreter (default: $DRAFTLAB_VLLM_PYTHON, else this one)")
    p.add_argument("--model", help="the target's HF directory for vLLM (default: the composed target's)")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3], metavar="K",
                   help="chain lengths (one draft server each)")
    p.add_argument("--levels", type=int, nargs="+", default=list(served_load.LEVELS), metavar="C")
    p.add_argument("--repeats", type=int, default=1, help="batches per level (the speed-up's [min, max])")
    p.add_argument("--per-category", type=int, default=4, help="Spec-Bench questions per category (13 categories)")
    p.add_argument("--prompts", type=int, help="then keep the first N of them")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (starts in ~1 min)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more vLLM flag, e.g. --server-arg=--max-num-seqs=16 (repeatable)")
    p.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--startup-timeout", type=float, default=1200)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override of conf/eval.yaml (target, bench, paths; repeatable)")
    p.add_argument("--plain-url", help="a running plain server (with --draft-url: no launches)")
    p.add_argument("--draft-url", help="a running server with the draft (chain length: --num-speculative-tokens)")
    p.add_argument("--name", help="the record's name (default: method and draft directory)")
    p.add_argument("--out", type=Path, help="the record (default: experiments/serving/records/concurrency_<name>.json)")
    p.add_argument("--work", type=Path, help="export and server logs (default: /tmp/draftlab_concurrency/<name>)")
    p.add_argument("--fresh", action="store_true", help="start a new record even where one exists")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    urls = (args.plain_url, args.draft_url)
    if any(urls) and not all(urls):
        p.error("--plain-url and --draft-url go together")
    if all(urls) and len(args.num_speculative_tokens) != 1:
        p.error("running servers have one chain length: give one --num-speculative-tokens")
    if not any(urls) and args.draft is None and args.export is None:
        p.error("give --draft DIR (exported here) or --export DIR (a vLLM export), or running servers")
    for flag, path in (("--draft", args.draft), ("--export", args.export)):
        if path is not None and not path.expanduser().is_dir():
            p.error(f"{flag} {path}: no such directory")
    if args.repeats < 1 or any(c < 1 for c in args.levels) or any(k < 1 for k in args.num_speculative_tokens):
        p.error("--repeats, --levels and --num-speculative-tokens take positive integers")


def _compose(args: argparse.Namespace):
    from draftlab.configs import compose_train_config

    return compose_train_config([f"method={args.method}", "bench=specbench", f"bench.per_category={args.per_category}",
                                 *args.override], config_name="eval")


def _prompts(cfg, limit: int | None) -> list[str]:
    """The bench's first turns, as the served evaluation asks them."""
    from hydra.utils import instantiate

    bench = instantiate(cfg.bench, _convert_="object")
    questions = bench.load()
    return [q.turns[0] for q in (questions if limit is None else questions[:limit])]


def _draft_side(args: argparse.Namespace, cfg, work: Path) -> dict[str, Any]:
    """The target's directory, the vLLM export to serve, the engine's method name, the draft's identity and the
    method's label and axes. With running servers nothing is built."""
    from draftlab.eval.served import serve_plan
    from draftlab.methods.registry import MethodSpec

    spec = MethodSpec(cfg.method)
    out: dict[str, Any] = {"label": spec.label, "model": args.model, "export": args.export, "draft_id": None,
                           "axes": spec.axes(None), "engine_method": serve_plan(cfg, "vllm")["method"]}
    if args.plain_url or (args.model and args.draft is None):
        return out
    from hydra.utils import instantiate

    target = instantiate(cfg.target)
    spec = spec.for_target(target)
    out["model"] = args.model or str(getattr(target.model.config, "_name_or_path", "") or target.name)
    if args.draft is not None:
        from draftlab.export import export_checkpoint
        from draftlab.methods.artifact import DraftArtifact

        artifact = DraftArtifact.open(spec, args.draft, target)
        out["draft_id"], out["axes"] = artifact.identity(), spec.axes(artifact.trained_config)
        fmt = serve_plan(cfg, "vllm")["format"]
        out["export"] = export_checkpoint(spec, args.draft, work / "draft_vllm", format=fmt, target=target)[fmt]
    return out


def machine_info() -> dict[str, Any]:
    """CPU model, cores (all and usable by this process) and memory: what the throughput was measured on."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "cpu_model": None, "memory_gib": None}
    with contextlib.suppress(AttributeError):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
        info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    return info


def _settings(args: argparse.Namespace, side: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
    return {"method": args.method, "model": side["model"], "draft": str(args.draft) if args.draft else None,
            "export": str(side["export"]) if side["export"] else None, "bench": "specbench",
            "per_category": args.per_category, "prompts": len(prompts),
            "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
            "max_tokens": args.max_tokens, "temperature": args.temperature, "dtype": args.dtype,
            "max_model_len": args.max_model_len, "server_args": (["--enforce-eager"] * args.enforce_eager
                                                                 + list(args.server_arg)),
            "kv_cache_gib": str(args.kv_cache_gib), "repeats": args.repeats,
            "urls": {"plain": args.plain_url, "draft": args.draft_url} if args.plain_url else None,
            "levels": list(args.levels), "num_speculative_tokens": list(args.num_speculative_tokens),
            "python": args.python, "overrides": list(args.override), "engine_method": side["engine_method"]}


def _record(out: Path, fresh: bool, name: str, settings: dict[str, Any], side: dict[str, Any]) -> dict[str, Any]:
    """The record at ``out`` to resume (its settings checked against this run's), or a new one."""
    if out.is_file() and not fresh:
        record = json.loads(out.read_text(encoding="utf-8"))
        conflicts = served_load.settings_conflicts(record.get("config") or {}, settings, MEASURE_KEYS)
        if conflicts:
            raise SystemExit(f"{out} holds levels measured under other settings ({'; '.join(conflicts)}): "
                             "pass --fresh to start over, or --name / --out for a new record")
        record["config"] = {**record["config"], "levels": sorted({*record["config"]["levels"], *settings["levels"]}),
                            "num_speculative_tokens": sorted({*record["config"]["num_speculative_tokens"],
                                                              *settings["num_speculative_tokens"]})}
        return record
    block = {"levels": settings["levels"], "repeats": settings["repeats"], "n_prompts": settings["prompts"],
             "max_tokens": settings["max_tokens"], "temperature": settings["temperature"], "draft_name": name,
             "machine": machine_info(), "servers": {}, "speedups": {}}
    return {"schema": tracking.RECORD_SCHEMA, "kind": "eval", "run_name": f"concurrency/{name}",
            "group": "served_load", "tags": ["concurrency", "vllm"],
            "choices": {"method": settings["method"], "bench": "specbench"}, "overrides": settings["overrides"],
            "config": settings, "git": tracking.git_info(), "hardware": tracking.hardware_info(),
            "artifacts": {"draft": settings["draft"], "data": None},
            "draft": side["draft_id"] or {"path": settings["draft"] or settings["export"], "sha256": None, "step": None},
            "metrics": {}, "train": None,
            "eval": {"bench": "specbench", "method": settings["method"], "label": side["label"],
                     "temperature": settings["temperature"], "axes": side["axes"],
                     "max_new_tokens": settings["max_tokens"], "engine": "vllm", "concurrency": block}}


def _launcher(args: argparse.Namespace, side: dict[str, Any], k: int | None, work: Path, entry: dict[str, Any]):
    """A context manager that brings up the server of chain length ``k`` (None: plain) and gives its URL; the
    start-up time, command and vLLM version go into ``entry``."""
    from draftlab.serving import VLLM_HEALTH, ServerProcess, free_port, get_json, vllm_command

    url = args.plain_url if k is None else args.draft_url
    if url:
        return lambda: contextlib.nullcontext(url)

    @contextlib.contextmanager
    def start():
        port = free_port()
        spec = {"method": side["engine_method"], "model": str(side["export"]), "num_speculative_tokens": k} if k else None
        cmd = vllm_command(side["model"], port=port, dtype=args.dtype, max_model_len=args.max_model_len,
                           served_model_name="target", speculative_config=spec, python=args.python,
                           extra=["--enforce-eager"] * args.enforce_eager + list(args.server_arg))
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "TOKENIZERS_PARALLELISM": "false"}
        log = work / f"vllm_{'plain' if k is None else f'k{k}'}.log"
        with ServerProcess(cmd, port=port, health_paths=VLLM_HEALTH, startup_timeout=args.startup_timeout,
                           log_path=log, env=env) as server:
            version = None
            with contextlib.suppress(Exception):
                version = get_json(server.url, "/version").get("version")
            entry.setdefault("startups", []).append({"startup_s": server.startup_s, "cmd": cmd, "log": str(log),
                                                     "version": version})
            yield server.url

    return start


def _stamp(servers: dict[str, dict], git: dict[str, Any]) -> None:
    """The commit each new level ran from (a resumed sweep may span several): read when this process started,
    since a sweep can outlive commits made while it runs."""
    for server in servers.values():
        for level in (server.get("levels") or {}).values():
            level.setdefault("git", git)


def _finish(record: dict[str, Any]) -> None:
    """Speed-ups per chain length against the plain server, flat metrics, and the record's ``git``: one commit
    only when every level ran from it, dirty when any level's tree was."""
    block = record["eval"]["concurrency"]
    servers = block["servers"]
    plain = (servers.get("plain") or {}).get("levels") or {}
    block["speedups"] = {name: served_load.speedups(plain, s.get("levels") or {})
                         for name, s in servers.items() if name != "plain"}
    block["levels"] = record["config"]["levels"]
    record["metrics"] = {f"served_load/{name}/c{row['concurrency']}/{key}": row[key]
                         for name, rows in block["speedups"].items() for row in rows
                         for key in ("speedup", "plain_tps", "draft_tps", "tau") if row[key] is not None}
    gits = [lvl.get("git") or {} for s in servers.values() for lvl in (s.get("levels") or {}).values()]
    if gits:
        commits = {g.get("commit") for g in gits}
        dirty = {g.get("dirty") for g in gits}
        record["git"] = {"commit": commits.pop() if len(commits) == 1 else None,
                         "dirty": True if True in dirty else (False if dirty == {False} else None)}


def _save(record: dict[str, Any], out: Path) -> None:
    from analysis.results import Record
    from analysis.served_concurrency import render_concurrency_markdown

    _finish(record)
    atomic_write_text(out, json.dumps(record, indent=2, default=str) + "\n")
    if any(record["eval"]["concurrency"]["speedups"].values()):
        atomic_write_text(out.with_suffix(".md"), render_concurrency_markdown([Record(out, record)]))


def _default_name(args: argparse.Namespace) -> str:
    """The method and the draft's artifact key (``.../eagle3/<key>/draft``), or the export's folder name."""
    if args.draft is not None:
        where = args.draft.expanduser().resolve()
        return f"{args.method}_{where.parent.name if where.name == 'draft' else where.name}"
    return f"{args.method}_{args.export.name if args.export is not None else 'urls'}"


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    git = tracking.git_info()
    name = args.name or _default_name(args)
    out = args.out or RECORDS / f"concurrency_{name}.json"
    work = args.work or Path("/tmp/draftlab_concurrency") / name
    work.mkdir(parents=True, exist_ok=True)
    cfg = _compose(args)
    prompts = _prompts(cfg, args.prompts)
    side = _draft_side(args, cfg, work)
    settings = _settings(args, side, prompts)
    record = _record(out, args.fresh, name, settings, side)
    servers = record["eval"]["concurrency"]["servers"]
    ask = dict(max_tokens=args.max_tokens, temperature=args.temperature, timeout=args.request_timeout)

    def save() -> None:
        _stamp(servers, git)
        _save(record, out)

    for k in [None, *args.num_speculative_tokens]:
        key = "plain" if k is None else f"k{k}"
        entry = servers.setdefault(key, {"num_speculative_tokens": k})
        served_load.resume_sweep(servers, key, _launcher(args, side, k, work, entry), prompts, args.levels,
                                 save=save, repeats=args.repeats, **ask)
    _save(record, out)
    print(f"record: {out}")
    md = out.with_suffix(".md")
    if md.is_file():
        print(md.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
