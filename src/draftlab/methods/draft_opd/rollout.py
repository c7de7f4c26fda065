"""Rollouts: lossless speculative decoding with the current draft, keeping every verification anchor.

Each prompt is decoded by the one engine (``speculative_generate(..., trace=True)``), so the output is the
target's own (greedy at T=0, the target distribution otherwise) and the anchors carry the target log-probs
its verify passes computed. Prompts are counted like regeneration: every prompt ends as a success, an
error (the exception is logged and the prompt is left out of this phase) or skipped (empty, or longer than
``max_prompt_tokens``), and ``success + error + skipped`` is the number of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.draft_opd.anchors import Anchor, trace_anchors
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class Rollout:
    """One decoded prompt: the committed sequence and the anchors of its rounds."""

    tokens: torch.Tensor  # [T] prompt + output
    prompt_len: int
    anchors: list[Anchor]

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len

    @property
    def rounds(self) -> int:
        return len(self.anchors)


@dataclass
class RolloutReport:
    """How a phase's prompts ended (``success + error + skipped == prompts``) and what they yielded."""

    prompts: int = 0
    success: int = 0
    error: int = 0
    skipped: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verify rounds, root-only ones included (τ's denominator)
    errors: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per verify round over the phase (the first token comes from the prefill, not a round)."""
        return (self.new_tokens - self.success) / max(1, self.rounds) if self.rounds else 0.0


def prompt_of(input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """The rendered conversation up to its first trained (assistant) token: the prompt a rollout continues."""
    n = int(attention_mask.sum())
    trained = loss_mask[:n].nonzero()
    end = int(trained[0]) if trained.numel() else 0
    return input_ids[:end].tolist()


def rollout(target, drafter, prompts: list[list[int]], cfg: GenerationConfig, *, vocab_ids: torch.Tensor | None,
            rejected_suffix: bool = True, max_prompt_tokens: int | None = None,
            dtype: torch.dtype = torch.float32) -> tuple[list[Rollout], RolloutReport]:
    """Decode ``prompts`` with ``drafter`` and return their rollouts (successes only) and the report."""
    report = RolloutReport(prompts=len(prompts))
    out: list[Rollout] = []
    for prompt in prompts:
        if not prompt or (max_prompt_tokens is not None and len(prompt) > max_prompt_tokens):
            report.skipped += 1
            continue
        try:
            new, stats = speculative_generate(target, prompt, drafter, cfg, trace=True)
        except Exception as err:  # one bad prompt must not end the phase; it is counted and logged
            report.error += 1
            report.errors.append(f"{type(err).__name__}: {err}")
            log.warning("rollout failed on a %d-token prompt: %s", len(prompt), err)
            continue
        anchors = trace_anchors(stats.trace, vocab_ids=vocab_ids, rejected_suffix=rejected_suffix, dtype=dtype)
        out.append(Rollout(torch.tensor(prompt + new, dtype=torch.long), len(prompt), anchors))
        report.success += 1
        report.new_tokens += len(new)
        report.rounds += stats.rounds
    assert report.success + report.error + report.skipped == report.prompts
    return out, report
