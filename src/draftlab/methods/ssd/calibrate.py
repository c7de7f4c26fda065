"""Calibrating Saguaro's fan-out on sample prompts: what verification accepts, and how often a cache would hit.

Synchronous speculative decoding with the base's chains (SSD with a fan-out of 0 and its cache built inline,
so any base with an ``outcome_drafter`` -- a draft model, EAGLE-3 -- is measured the way SSD runs it) records every
round's outcome ``(j, t)``; the glue pass of the verified state the round was drafted in gives, for the
position j where verification stopped, the rank of the bonus token t among that position's candidates
(``saguaro.candidates``: the draft's top tokens without the drafted one). From those:

- the per-position acceptance ``a`` (accepted / tried over all positions, the geometric law's MLE);
- the miss rate of a uniform fan-out F, ``P(rank >= F)``, and Saguaro's power law ``1 - p_hit(F) = F^-r``
  fitted by least squares in log-log over F = 1..``max_width``;
- ``hit_rate(fanout)`` for any fan-out vector, from the same outcomes (how the fan-out plot is drawn).

``Calibration`` (``calibration.py``) is the artifact (``calibration.json``, written atomically, with what was measured in its
``source``): the SSD drafter reads it with ``fanout: geometric`` and ``calibration: <path>``. The command line
composes the SSD method config as a run would and keeps the result under a content key of that source
(``<artifacts>/ssd_calibration/<key>/calibration.json``), reused when it is there::

    python -m draftlab.methods.ssd.calibrate method.base.drafter.layers=24 method.base.drafter.depth=3
    python -m draftlab.methods.ssd.calibrate method=ssd_eagle3 draft_path=<artifacts>/eagle3/<key>/draft \
        --temperature 0.7 --out calibration/eagle3_t07.json
"""

from __future__ import annotations

import math
from contextlib import closing
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.ssd.cache import OutcomeCache
from draftlab.methods.ssd.calibration import Calibration
from draftlab.methods.ssd.saguaro import candidates

RANK_CAP = 64  # ranks beyond this count as "never cached" (no fan-out gets near it)


def fit_power(miss: dict[int, float]) -> float:
    """r of ``miss(F) = F^-r``, least squares through the origin in (log F, -log miss) over F >= 2 with miss > 0
    (F = 1 carries no slope: log 1 = 0)."""
    pts = [(math.log(f), -math.log(m)) for f, m in miss.items() if f >= 2 and 0 < m < 1]
    if not pts:
        return 1.0  # nothing to fit (every outcome cached, or none): a neutral exponent
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    return float((x * y).sum() / (x * x).sum())


class _Outcomes(OutcomeCache):
    """A cache that builds only the glue pass (fan-out 0: no branches, every round a miss, i.e. synchronous
    speculative decoding with the base's chains) and, at each lookup, records where verification stopped and
    the rank of the bonus among that position's candidates, from the glue pass of the verified state the round
    was drafted in."""

    def __init__(self, outcome_drafter):
        super().__init__(outcome_drafter)
        self.outcomes: list[tuple[int, int]] = []
        self.tried = self.accepted = 0
        self._glued: tuple[list[int], torch.Tensor] | None = None

    def build(self, **request) -> None:
        self.entries = {}
        self.outcome_drafter.absorb(request["verified"])
        self._glued = (request["chain"], self.outcome_drafter.glue(request["context"], request["chain"]))  # [K+1, V]

    def lookup(self, key):
        if key is not None and self._glued is not None:  # None: the round was cut (EOS, budget), no next round
            (j, t), (chain, z) = key, self._glued
            ranked = candidates(z[j], RANK_CAP, chain[j] if j < len(chain) else None)
            self.outcomes.append((j, ranked.index(t) if t in ranked else RANK_CAP))
            self.tried += min(j + 1, len(chain))
            self.accepted += j
        self._glued = None
        return None


def measure(target, base, prompts: list[list[int]], *, depth: int, temperature: float, max_new_tokens: int = 128,
            seed: int = 0, max_width: int = 8, source: dict | None = None) -> Calibration:
    """Decode ``prompts`` with the base's chains of ``depth`` (any drafter with an ``outcome_drafter``: a draft
    model, EAGLE-3) and measure the outcomes (module docstring)."""
    from draftlab.methods.ssd.drafter import SSDDrafter

    ssd = SSDDrafter(base=base, depth=depth, fanout="uniform", per_position=0, worker="inline")
    ssd._start(target)
    cache = ssd.worker.cache = _Outcomes(ssd.worker.cache.outcome_drafter)
    with closing(ssd):
        for i, prompt in enumerate(tqdm(prompts, desc=f"calibrate (T={temperature})", unit="prompt")):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                                   stop_on_eos=True)
            speculative_generate(target, prompt, ssd, cfg)
    tried, accepted = cache.tried, cache.accepted
    accept = min(max(accepted / tried, 1e-3), 1 - 1e-3) if tried else 0.5
    cal = Calibration(depth=int(depth), temperature=float(temperature), accept=accept, power=1.0,
                      rounds=len(cache.outcomes), outcomes=cache.outcomes, source=dict(source or {}))
    cal.power = fit_power({f: cal.miss_rate(f) for f in range(1, max_width + 1)})
    return cal


# ---- the command line -------------------------------------------------------------------------------------


def sharegpt_prompts(path: str | Path, tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    """The first ``n`` first user turns of a ShareGPT file that render (chat template) to at most ``max_tokens``."""
    from draftlab.data.conversations import load_sharegpt
    from draftlab.data.template import render_prompt

    prompts = []
    for conv in load_sharegpt(path):
        first = next((m for m in conv.messages if m["role"] == "user"), None)
        if first is None:
            continue
        ids = render_prompt(tokenizer, [first])
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def main(argv: list[str] | None = None) -> Path:
    import argparse

    from hydra.utils import instantiate

    from draftlab.configs import compose_train_config
    from draftlab.methods.registry import MethodSpec
    from draftlab.tracking import weights_sha256
    from draftlab.utils.hashing import content_key

    ap = argparse.ArgumentParser(description="Calibrate SSD's geometric fan-out for the base of an SSD config.")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=16, help="ShareGPT first user turns (not the benchmark's)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default=None, help="default: <artifacts>/ssd_calibration/<key>/calibration.json")
    ap.add_argument("overrides", nargs="*", help="config overrides (method=ssd_eagle3, draft_path=DIR, target=...)")
    args = ap.parse_intermixed_args(argv)
    cfg = compose_train_config(["method=ssd", "target=smollm2_135m", *args.overrides])
    target = instantiate(cfg.target)
    spec = MethodSpec(cfg.method).for_target(target)
    draft = None
    if spec.trainable:
        if not cfg.get("draft_path"):
            raise ValueError(f"method '{spec.name}' drafts with a trained draft: pass draft_path=DIR")
        draft = spec.load(Path(str(cfg.draft_path)).expanduser(), target).to(target.dtype).eval()
    ssd = spec.build_drafter(draft) if spec.trainable else spec.build_drafter()
    ssd.close()  # only its base and depth are used
    sharegpt = Path(str(cfg.paths.shared_data)) / "conversations" / "sharegpt_v3_first5000.jsonl"
    base_cfg = {k: v for k, v in spec.resolved()["base"].items() if k not in ("label", "ci")}
    source = {"target": str(getattr(target, "name", cfg.target.get("name"))), "method": spec.name,
              "base": base_cfg, "draft_sha256": None if draft is None else weights_sha256(draft),
              "depth": ssd.depth, "temperature": args.temperature,
              "prompts": f"ShareGPT first user turns, first {args.prompts} of <= {args.max_prompt_tokens} tokens",
              "max_new_tokens": args.max_new_tokens}
    out = Path(args.out) if args.out else (Path(str(cfg.paths.artifacts)) / "ssd_calibration" / content_key(source)
                                           / "calibration.json")
    if out.exists():
        kept = Calibration.load(out)
        if kept.source == source:
            print(f"reused {out}: a = {kept.accept:.3f}, r = {kept.power:.3f} ({kept.rounds} rounds)")
            return out
    prompts = sharegpt_prompts(sharegpt, target.tokenizer, args.prompts, args.max_prompt_tokens)
    with torch.inference_mode():
        cal = measure(target, ssd.base, prompts, depth=ssd.depth, temperature=args.temperature,
                      max_new_tokens=args.max_new_tokens, source=source)
    cal.save(out)
    print(f"{out}: {cal.rounds} rounds, a = {cal.accept:.3f}, r = {cal.power:.3f}")
    for f in range(1, 9):
        print(f"  uniform F = {f}: miss rate {cal.miss_rate(f):.3f} (power law {f ** -cal.power:.3f})")
    return out


if __name__ == "__main__":
    main()
