"""SSD / Saguaro (Kumar, Dao, May, ICLR 2026): speculative speculative decoding.

Ordinary speculative decoding alternates: the draft waits while the target verifies, the target waits while
the draft drafts. Here the base outcome_drafter's copy in a worker (``worker.py``) builds, *while the engine
verifies round T*, a next chain for each likely outcome ``(j accepted, bonus t)`` of that round
(``cache.py``, fan-outs and sampling in ``saguaro.py``). Each round:

1. ``propose``: the outcome of the last round (``update`` keeps it) is looked up in the cache the worker
   built meanwhile. Hit: the cached chain, with no drafting at all. Miss (or the first round of a sequence):
   the backup -- ``jit``: the base drafts now; ``fast``: a cheap deterministic drafter (prompt lookup).
   The worker is then asked to build the cache for this chain, and ``propose`` returns it to the engine.
2. The engine verifies (the one verifier); the worker builds in parallel.
3. ``update``: the outcome ``(j, t)`` is the next key.

Exactness: the verifier decides everything. A cached chain was drawn (T > 0) from the law it carries as
``draft_probs`` -- σ_{F,C} when ``scale < 1``, the same law the worker sampled from -- by the worker's own
generator, whatever key is served; a fast backup's chain is deterministic (the deterministic-candidate
rule). Hit rate, time blocked on the worker, cache-build time and tokens per round on hits and misses are the
drafter's ``sequence_stats`` (kept in the answer records).
"""

from __future__ import annotations

import time

import torch

from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.outcome_drafter import DraftsOutcomes, OutcomeChain, OutcomeDrafter, Sampling
from draftlab.decoding.tree import DraftTree
from draftlab.methods.ssd.saguaro import Reshaper, geometric_fanout, uniform_fanout
from draftlab.methods.ssd.worker import InlineWorker, ProcessWorker

BACKUPS = ("jit", "fast")
WORKERS = ("process", "inline", "none")
FANOUTS = ("uniform", "geometric")


class SSDDrafter(Drafter):
    """draft           a trained base's draft (``conf/method/ssd_eagle3.yaml``): ``base`` is then the factory
                    of its drafter, called with it.
    base            the drafter of the base method (it must have ``outcome_drafter(target)``: ``DraftsOutcomes``).
    depth           tokens per chain (K).
    fanout          ``uniform`` (``per_position`` candidates at each outcome position) or ``geometric``
                    (``candidates`` in all, spread by ``accept`` a and ``power`` r, Saguaro's Thm 12; ``calibration``: the path of a
                    measured ``calibration.Calibration``, whose a and r are used instead).
    scale           Saguaro's C in (0, 1]: 1 is plain sampling from q.
    backup          ``jit`` (the base drafts on a miss) or ``fast`` (``fast``, a deterministic drafter).
    worker          ``process`` (its own process, ``worker_threads`` threads, on ``worker_cpus``), ``inline``, or
                    ``none``: no cache, every round is the backup -- synchronous speculative decoding with the
                    same base and the same sampling (the baseline SSD is measured against).
    """

    def __init__(self, draft=None, *, base: Drafter, depth: int = 4, fanout: str = "uniform", per_position: int = 3,
                 candidates: int = 12, accept: float = 0.6, power: float = 1.0, calibration: str | None = None,
                 scale: float = 1.0,
                 backup: str = "jit", fast: Drafter | None = None, worker: str = "process", worker_threads: int = 1,
                 worker_cpus: list[int] | None = None):
        if backup not in BACKUPS or worker not in WORKERS or fanout not in FANOUTS:
            raise ValueError(f"backup must be one of {BACKUPS}, worker one of {WORKERS}, fanout one of {FANOUTS}; "
                             f"got {backup!r}, {worker!r}, {fanout!r}")
        if not 0.0 < float(scale) <= 1.0:
            raise ValueError(f"scale (Saguaro's C) must be in (0, 1], got {scale}")
        if backup == "fast" and fast is None:
            raise ValueError("backup 'fast' needs a fast drafter (drafter.fast)")
        if draft is not None:  # a trained base: its drafter is built around the run's draft
            base = base(draft)
        self.base, self.fast, self.depth = base, fast, int(depth)
        if calibration is not None:  # a measured a and r replace the configured ones
            from draftlab.methods.ssd.calibration import Calibration

            cal = Calibration.load(calibration)
            if cal.depth != self.depth:
                raise ValueError(f"{calibration}: calibrated for chains of {cal.depth} tokens, this drafter drafts "
                                 f"{self.depth}")
            accept, power = cal.accept, cal.power
        self.fanout = (uniform_fanout(per_position, self.depth) if fanout == "uniform"
                       else geometric_fanout(candidates, self.depth, accept=accept, r=power))
        self.scale, self.backup = float(scale), backup
        self.worker_kind, self.worker_threads = worker, int(worker_threads)
        self.worker_cpus = None if worker_cpus is None else [int(c) for c in worker_cpus]
        self.worker = None
        self._outcome_drafter: OutcomeDrafter | None = None
        self._outstanding = False  # a build was sent: the next propose (or reset) must look it up
        self._outcome: tuple[int, int] | None = None
        self._hit = False
        self._seed = 0
        self._round = 0
        self._unabsorbed: list = []  # verified rows the engine-side outcome_drafter has not taken in (jit drafts lazily)
        self._stats: dict[str, float] = {}

    def scratch_rows(self, cfg) -> int:
        return 1 + self.depth

    def taps(self, target) -> list[int] | None:
        return self.base.taps(target)  # a feature base (EAGLE-3) reads the verified tokens' features

    # ---- lifecycle ---------------------------------------------------------------------------------

    def _start(self, target) -> None:
        if not isinstance(self.base, DraftsOutcomes):
            raise ValueError(f"SSD's base {type(self.base).__name__} cannot draft after an unverified "
                             "outcome (it has no outcome_drafter(target): decoding.outcome_drafter.DraftsOutcomes); use a "
                             "base that can, e.g. method@method.base=draft_model")
        outcome_drafter = self.base.outcome_drafter(target)
        self._outcome_drafter = outcome_drafter
        if self.worker_kind == "none":
            return
        if self.worker_kind == "inline":
            self.worker = InlineWorker(outcome_drafter.portable()())
        else:
            self.worker = ProcessWorker(outcome_drafter.portable(), threads=self.worker_threads, cpus=self.worker_cpus)

    def reset(self, state: DecodeState) -> None:
        if self._outcome_drafter is None:
            self._start(state.target)
        self._drain()
        self._unabsorbed = []
        if self.fast is not None:
            self.fast.reset(state)
        dev = state.generator.device if state.generator is not None else "cpu"
        self._seed = int(torch.randint(2 ** 62, (1,), generator=state.generator, device=dev))
        self._round, self._outcome = 0, None
        self._stats = {"rounds": 0, "lookups": 0, "hits": 0, "blocked_s": 0.0, "build_s": 0.0, "backup_s": 0.0,
                       "tokens_hit": 0, "tokens_miss": 0, "rounds_hit": 0, "rounds_miss": 0}

    def _drain(self) -> None:
        if self._outstanding:
            self.worker.lookup(None)
            self._outstanding = False

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self._outcome_drafter = None
        self._outstanding = False

    # ---- rounds ------------------------------------------------------------------------------------

    def propose(self, state: DecodeState) -> DraftTree:
        spec = None
        verified = self._outcome_drafter.verified(state)  # what the worker's copy learns of this round's outcome
        if verified is not None and self.backup == "jit":
            self._unabsorbed.append(verified)
        if self._outstanding:
            t0 = time.perf_counter()
            spec, built = self.worker.lookup(self._outcome)
            self._stats["blocked_s"] += time.perf_counter() - t0
            self._stats["build_s"] += built
            self._stats["lookups"] += 1
            self._outstanding = False
        self._hit = spec is not None
        if self._hit:
            self._stats["hits"] += 1
            tree = spec.tree(state.root)
        else:
            t0 = time.perf_counter()
            tree = self._backup(state)
            self._stats["backup_s"] += time.perf_counter() - t0
        self._round += 1
        if self.worker is not None:
            self.worker.build(context=list(state.tokens), chain=tree.tokens[1:].tolist(), verified=verified,
                              fanout=self.fanout, depth=self.depth, temperature=state.temperature, top_k=state.top_k,
                              top_p=state.top_p, seed=self._seed + self._round, scale=self.scale)
            self._outstanding = True
        return tree

    def _backup(self, state: DecodeState) -> DraftTree:
        if self.backup == "fast":
            tree = self.fast.propose(state)
            if not bool((tree.parents[1:] == torch.arange(tree.size - 1, device=tree.parents.device)).all()):
                raise ValueError("SSD's fast backup must propose a chain (e.g. prompt lookup with num_branches=1)")
            return DraftTree.chain(state.root, tree.tokens[1:])  # deterministic: no draft law
        for verified in self._unabsorbed:
            self._outcome_drafter.absorb(verified)
        self._unabsorbed = []
        reshape = Reshaper(self.fanout, self.scale) if self.scale < 1.0 else None
        spec: OutcomeChain = self._outcome_drafter.chain(state.tokens, self.depth, Sampling.of(state), reshape)
        return spec.tree(state.root)

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        path = out.result.path
        # The next key: the whole round was kept (a round cut at EOS or the token budget ends the sequence).
        self._outcome = (len(path) - 1, int(out.result.bonus_token)) if out.kept == len(path) else None
        which = "hit" if self._hit else "miss"
        self._stats["rounds"] += 1
        self._stats[f"rounds_{which}"] += 1
        self._stats[f"tokens_{which}"] += out.kept
        if self.fast is not None:
            self.fast.update(state, out)

    def sequence_stats(self) -> dict[str, float]:
        s = dict(self._stats)
        s["hit_rate"] = s["hits"] / s["lookups"] if s.get("lookups") else 0.0
        return s
