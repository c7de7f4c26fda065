"""Served acceptance during training: every N steps the current draft is exported, served and measured.

A draft can look right in training (simulated τ) and accept far less once an engine runs it; finding out after
training wastes the run. ``ServedEval`` (``callbacks=served_eval``) exports the module's draft every
``every_n_steps`` optimiser steps and at the end, serves it beside the target, asks a small fixed prompt set
(greedy, one at a time) and logs the engine's own τ and per-position acceptance (``served/tau``,
``served/acc_<i>``) to the loggers, the training history (so ``draftlab-report`` plots them against the
simulated τ the module logs) and ``<artifact dir>/served_eval.csv``.

The server is kept warm across checks: the first check starts it (the target plus the draft, timed), later
checks overwrite the export in place and ask the server to reload only the draft's weights
(``serving/vllm_side/draft_reload.py`` through ``/collective_rpc``). At T = 0 a lossless engine answers every
check with the same tokens whatever the draft, so a reload that changed anything but the draft shows at once:
then, and whenever a reload or a request fails, the server is started afresh. ``verify_reload`` ends the run
with one fresh launch on the final export and records its τ beside the reloaded server's.

A check never stops training: a failure is logged (``served/failed``, the error in the CSV) and retried
``retries`` times; a check that still fails is skipped and the next one starts over. ``url`` points the
checks at a server that is already running (no export, no launch: the stub servers of the tests, or a server
the user manages).
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any

import lightning as L

from draftlab.utils.logging import get_logger

log = get_logger(__name__)

RELOAD_EXTENSION = "draft_reload.DraftReload"  # module on the server's PYTHONPATH (serving/vllm_side)
RELOAD_METHOD = "draftlab_reload_draft"


class ServedEval(L.Callback):
    """See the module docstring. ``served``: overrides of ``eval.served`` (python, dtype, env, extra, ...) for
    the checks' server; ``prompts`` / ``max_tokens`` / ``num_speculative_tokens``: what each check asks."""

    def __init__(self, every_n_steps: int | None = 50, at_end: bool = True, prompts: int = 4, max_tokens: int = 48,
                 num_speculative_tokens: int = 3, retries: int = 2, retry_wait: float = 5.0, reload: bool = True,
                 verify_reload: bool = False, url: str | None = None, engine: str = "vllm",
                 served: dict[str, Any] | None = None):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or null, got {every_n_steps}")
        self.every, self.at_end, self.n_prompts, self.max_tokens = every_n_steps, at_end, prompts, max_tokens
        self.k, self.retries, self.retry_wait, self.reload = num_speculative_tokens, retries, retry_wait, reload
        self.verify_reload, self.url, self.engine, self.overrides = verify_reload, url, engine, {
            k: v for k, v in dict(served or {}).items() if v is not None}
        self.rows: list[dict[str, Any]] = []
        self.last_step: int | None = None
        self._run: dict[str, Any] | None = None
        self._server = None
        self._reference: list | None = None  # the first check's token ids: every later check must repeat them

    # -- the run it measures (the training stage calls this) ---------------------------------------------------
    def bind_run(self, *, cfg, spec, target, root: Path) -> None:
        """The method, target, prompts and server settings of the run; fails before training when the method
        has no way to be served."""
        from omegaconf import OmegaConf, open_dict

        from draftlab.eval.served import _prompts, require_engine, serve_plan, served_settings
        from draftlab.utils.errors import ConfigError

        merged = cfg.copy()
        with open_dict(merged):
            merged.eval.served = OmegaConf.merge(merged.eval.get("served") or {}, self.overrides,
                                                 {"num_speculative_tokens": self.k, "prompts": self.n_prompts})
        s = served_settings(merged)
        plan = serve_plan(merged, self.engine)
        _, prompts = _prompts(merged, s, target.tokenizer)
        model = str(getattr(target.model.config, "_name_or_path", "") or target.name)
        out = Path(root) / "served_eval"
        if not self.url:  # an engine the checks cannot start fails now, not as a failed check every N steps
            try:
                require_engine(self.engine, s, model, out / "export", plan["method"])
            except ConfigError as e:
                raise ConfigError(f"served checks: {e}; for the checks set callbacks.served_eval.served.python (or "
                                  "callbacks.served_eval.url)", field="callbacks.served_eval.served.python") from e
        self._run = {"spec": spec, "target": target, "settings": s, "plan": plan, "prompts": prompts,
                     "model": model, "out": out, "monitor": spec.monitor}

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if self.every and step > 0 and step % self.every == 0 and step != self.last_step:
            self.check(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            if self.at_end and int(trainer.global_step) != self.last_step:
                self.check(trainer, pl_module)
            if self.verify_reload and self._server is not None and trainer.is_global_zero:
                self._verify_fresh(trainer)
        finally:
            self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.last_step = list(state.get("rows", [])), state.get("last_step")

    # -- one check -------------------------------------------------------------------------------------------
    def check(self, trainer, pl_module) -> dict[str, Any] | None:
        """Export, serve, ask, log; retried; never raises (but for an interrupt)."""
        self.last_step = step = int(trainer.global_step)
        if not trainer.is_global_zero:
            return None
        if self._run is None:
            raise RuntimeError("ServedEval was not bound to a run (the training stage calls bind_run)")
        t0, errors = time.perf_counter(), []
        for attempt in range(self.retries + 1):
            try:
                row = self._measure(pl_module) | {"attempts": attempt + 1}
                break
            except Exception as e:  # noqa: BLE001 - any failure of a check is logged, training goes on
                errors.append(f"{type(e).__name__}: {e}"[:500])
                log.warning("served check at step %d failed (attempt %d of %d): %s", step, attempt + 1,
                            self.retries + 1, errors[-1])
                self._drop_server()
                if attempt < self.retries:
                    time.sleep(self.retry_wait)
        else:
            row = {"failed": 1, "attempts": self.retries + 1}
        row |= {"check_s": round(time.perf_counter() - t0, 3), "errors": errors}
        self._record(trainer, step, row)
        return row

    def _measure(self, pl_module) -> dict[str, Any]:
        from draftlab.eval.served_metrics import query_server

        url, serve = self._serve(pl_module)
        s = self._run["settings"]
        answers, counters = query_server(url, self._run["prompts"], max_tokens=self.max_tokens, model="target",
                                         timeout=float(s["request_timeout"]), desc="served check")
        ids = [a.token_ids for a in answers]
        if self._reference is None:
            self._reference = ids
        elif ids != self._reference:
            changed = sum(a != b for a, b in zip(ids, self._reference))
            raise RuntimeError(f"{changed} of {len(ids)} greedy answers changed since the first check: the served "
                               "target is not the one first loaded (a reload touched it); starting afresh")
        if counters.tau is None:
            raise RuntimeError(f"the server at {url} counted no draft rounds: is it serving the draft?")
        row = {"tau": counters.tau, "failed": 0, "drafts": counters.drafts, "accepted": counters.accepted}
        row |= {f"acc_{i}": r for i, r in enumerate(counters.position_rates)}
        return row | serve

    # -- the server ------------------------------------------------------------------------------------------
    def _serve(self, pl_module) -> tuple[str, dict[str, Any]]:
        """(url, how this check got its server: reload / launch seconds)."""
        if self.url:
            return self.url, {"mode": "url"}
        export_s = self._export(pl_module)
        if self._server is not None and self._server.running and self.reload:
            t0 = time.perf_counter()
            self._reload(self._server.url)
            return self._server.url, {"mode": "reload", "export_s": export_s,
                                      "reload_s": round(time.perf_counter() - t0, 3)}
        self._drop_server()
        self._reference = None  # a new server: its first answers are the new reference
        self._server = self._launch()
        return self._server.url, {"mode": "launch", "export_s": export_s, "startup_s": round(self._server.startup_s, 3)}

    def _export(self, pl_module) -> float:
        import torch

        from draftlab.utils.atomic import atomic_dir

        run, t0 = self._run, time.perf_counter()
        fmt, out = run["plan"]["format"], run["out"] / "export"
        out.parent.mkdir(parents=True, exist_ok=True)
        with torch.no_grad(), atomic_dir(out) as tmp:
            run["spec"].export(fmt, pl_module.draft, tmp, target=run["target"], dtype=run["settings"]["dtype"])
            problems = run["spec"].validate_export(fmt, tmp, target=run["target"])
            if problems:
                raise RuntimeError("the export would not be valid: " + "; ".join(problems))
        return round(time.perf_counter() - t0, 3)

    def _launch(self, fresh_log: str | None = None):
        """A server with the draft, its workers able to reload the draft (``draft_reload``)."""
        from draftlab.eval.served import _server

        run, s = self._run, dict(self._run["settings"])
        side = Path(__file__).resolve().parents[1] / "serving" / "vllm_side"
        s["extra"] = [*s["extra"], "--no-enable-prefix-caching"]  # no draft KV from before a reload is reused
        if self.reload:
            s["extra"] += ["--worker-extension-cls", RELOAD_EXTENSION]
            s["env"] = {**(s["env"] or {}), "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(side)}
        log_path = run["out"] / (fresh_log or f"server_{len(self.rows):03d}.log")
        server = _server(self.engine, run["model"], s, run["out"] / "export", run["plan"]["method"], log_path, k=self.k)
        return server.start()

    def _reload(self, url: str) -> None:
        """``/collective_rpc``: every worker reloads the draft from the export (an HTTP error raises)."""
        import urllib.request

        body = json.dumps({"method": RELOAD_METHOD, "args": [str(self._run["out"] / "export")]}).encode()
        request = urllib.request.Request(url + "/collective_rpc", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=float(self._run["settings"]["request_timeout"])) as resp:
            log.info("draft reloaded: %s", resp.read(200).decode(errors="replace"))

    def _drop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = None

    def close(self) -> None:
        self._drop_server()

    def _verify_fresh(self, trainer) -> None:
        """The final export in a fresh server: its τ beside the reloaded server's last one."""
        from draftlab.eval.served_metrics import query_server

        last = next((r for r in reversed(self.rows) if not r.get("failed")), None)
        self._drop_server()
        server = None
        try:
            server = self._launch(fresh_log="server_fresh.log")
            _, counters = query_server(server.url, self._run["prompts"], max_tokens=self.max_tokens,
                                       model="target", desc="fresh launch")
        except Exception as e:  # noqa: BLE001 - the check is a record, not a reason to fail the run
            log.warning("fresh-launch verification failed: %s", e)
            return
        finally:
            if server is not None:
                server.stop()
        row = {"fresh_tau": counters.tau, "reloaded_tau": last.get("tau") if last else None,
               "mode": "fresh", "startup_s": round(server.startup_s or 0.0, 3), "failed": 0}
        log.info("served tau, reloaded server %s vs fresh launch %s (same final export)",
                 row["reloaded_tau"], row["fresh_tau"])
        self._record(trainer, int(trainer.global_step), row)

    # -- logging ---------------------------------------------------------------------------------------------
    def _record(self, trainer, step: int, row: dict[str, Any]) -> None:
        monitor = self._run["monitor"] if self._run else None
        simulated = trainer.callback_metrics.get(monitor) if monitor else None
        row = {"step": step, **row, "simulated_tau": float(simulated) if simulated is not None else None}
        self.rows.append(row)
        numbers = {f"served/{k}": float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for logger in trainer.loggers:
            logger.log_metrics(numbers, step=step)
        for cb in trainer.callbacks:  # the training history (record, report): whoever keeps one
            if hasattr(cb, "add_row"):
                cb.add_row(trainer, {k: v for k, v in numbers.items() if k != "served/simulated_tau"})
        if self._run is not None:
            self._write_csv()
        if row.get("mode") != "fresh":  # the fresh launch logs its own line
            state = "FAILED" if row.get("failed") else f"tau {row['tau']:.3f}"
            log.info("served check at step %d: %s (%s, %.0f s)", step, state, row.get("mode", "-"), row["check_s"])

    def _write_csv(self) -> None:
        from draftlab.utils.atomic import atomic_write_text

        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=keys)
        writer.writeheader()
        for r in self.rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
        self._run["out"].mkdir(parents=True, exist_ok=True)
        atomic_write_text(self._run["out"].parent / "served_eval.csv", buf.getvalue())
