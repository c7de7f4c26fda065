"""Draft-OPD as a LightningModule: rollout phases with the current draft, replay steps with gradients.

Training alternates two phases over the prompts of the data module (whose batches repeat
``refresh_every`` times, so one batch of prompts serves one phase):

- **rollout** (the first step of a phase): every prompt is decoded losslessly by the one engine with the
  base's own drafter and the current weights (``rollout.rollout``); each verification round becomes an
  ``Anchor`` (accepted path, first rejected node and its suffix, rejected siblings, the verify pass's
  target log-probs over the draft vocabulary);
- **replay** (every step of the phase): ``sequences_per_step`` rollouts, in a seeded order, are replayed
  by the base's ``replay`` seam (the draft re-proposes each chain with its own earlier tokens as
  inputs, with gradients) and scored by the acceptance-aware ``objective.Objective``.

The rollout buffer, its phase and the step counter are part of the checkpoint, so a run killed in the
middle of a phase resumes with the same anchors and ends with the same weights. Checkpoint format, frozen
embedding and RNG handling are the base module's (``base`` is the base's own module factory),
so a Draft-OPD checkpoint loads wherever the base's does.

Validation decodes the held-out prompts with the current draft and logs ``val/tau`` (tokens per verify
round, the quantity the method optimises); ``conf/method/draft_opd.yaml`` names it as the ``monitor``.
"""

from __future__ import annotations

from contextlib import closing
from functools import partial
from typing import Any

import lightning as L
import torch

from draftlab.decoding.engine import GenerationConfig
from draftlab.methods.draft_opd.anchors import Anchor, round_anchor
from draftlab.methods.draft_opd.objective import Objective, ReplayBatch
from draftlab.methods.draft_opd.rollout import Rollout, RolloutReport, prompt_of, rollout
from draftlab.methods.draft_opd.rounds import rounds_at
from draftlab.training.losses import Loss
from draftlab.training.schedule import configure

ANCHOR_RULES = ("error", "random", "random_rounds")


class DraftOPDModule(L.LightningModule):
    """On-policy distillation of any trainable draft (see the module docstring).

    draft              the base's draft (usually continued from an existing artifact).
    target             the frozen target.
    base            the base method's module factory ``(draft=, target=) -> LightningModule``; only its
                       checkpoint hooks are used (the format of the base's own checkpoints).
    drafter            the base's drafter factory ``(draft) -> Drafter``: rollouts decode with it, with
                       ``rollout_drafter`` (keyword overrides, e.g. ``{tree: fixed}``: a tree sized from timed
                       verify costs would make the rollouts depend on the machine's load) applied.
    replay             the base's replay seam (``vocab_ids(draft)``, ``features(draft, target, tokens)``,
                       ``logprobs(draft, target, tokens, roots, chains, features)``).
    generation         rollout decoding settings (``GenerationConfig`` fields; T=0 as the official code).
    refresh_every      replay steps per rollout phase (the data module repeats each batch this many times).
    sequences_per_step rollouts replayed per optimiser step.
    rejected_suffix    replay the rejected node's own descendants too (the whole rejected suffix of a chain).
    anchors            ``error`` (verification anchors, the method); ``random`` (the paper's ablation as
                       built here: as many anchors at random response positions, replaying the committed
                       continuation, all accepted, target log-probs from one teacher-forced target pass; so
                       it changes the objective too: no rejected positions, no reverse-KL term); or
                       ``random_rounds`` (only the placement changes: as many anchors at random response
                       positions, each a real verification round of the rollout drafter from there, with
                       accepted path, rejected node and suffix and the verify pass's target log-probs,
                       ``rounds.rounds_at``).
    objective          ``objective.Objective`` fields (gamma, lambda_acc, lambda_rej, estimator, divergence).
    loss               the loss menu's choice (``conf/loss``), in place of the two KLs (``objective.Objective``).
    max_prompt_tokens  longer prompts are skipped (counted).
    """

    def __init__(self, draft, target=None, *, base, drafter, replay, rollout_drafter: dict | None = None,
                 generation: dict | None = None,
                 refresh_every: int = 4, sequences_per_step: int = 2, rejected_suffix: bool = True,
                 anchors: str = "error", objective: dict | None = None, max_prompt_tokens: int | None = 1024,
                 optimizer=None, schedule=None, total_steps: int | None = None, seed: int = 0, loss=None):
        super().__init__()
        if refresh_every < 1 or sequences_per_step < 1:
            raise ValueError(f"need refresh_every >= 1 and sequences_per_step >= 1, got {refresh_every}, "
                             f"{sequences_per_step}")
        if anchors not in ANCHOR_RULES:
            raise ValueError(f"module.anchors must be one of {ANCHOR_RULES}, got '{anchors}'")
        self.draft = draft
        self.target = target  # not an nn.Module attribute: never in state_dict
        # The base's module, unregistered (its draft is ours): checkpoints are written in its format.
        object.__setattr__(self, "base_module", base(draft=draft, target=target))
        self.drafter_factory = partial(drafter, **dict(rollout_drafter or {}))
        self.replay = replay
        self.generation = GenerationConfig(**{"stop_on_eos": True, **(generation or {})})
        self.refresh_every, self.sequences_per_step = int(refresh_every), int(sequences_per_step)
        self.rejected_suffix, self.anchor_rule = bool(rejected_suffix), anchors
        self.objective = Objective(**(objective or {}), menu=Loss.of(loss))
        self.max_prompt_tokens = max_prompt_tokens
        self.optimizer_factory = optimizer  # conf/method/<m>.yaml's module.optimizer: its defaults live there
        self.schedule_factory = schedule
        self.total_steps = total_steps
        self.seed = int(seed)
        self.buffer: list[Rollout] = []
        self.buffer_phase = -1
        self.steps_done = 0  # training steps (batches) taken: phase = steps_done // refresh_every
        self._features: dict[int, torch.Tensor] = {}  # per phase, recomputed after a resume (deterministic)
        self._val: RolloutReport | None = None

    # ---- rollouts -----------------------------------------------------------------------------------------

    def vocab_ids(self) -> torch.Tensor:
        return self.replay.vocab_ids(self.draft).cpu()

    def _prompts(self, batch: dict[str, torch.Tensor]) -> list[list[int]]:
        return [prompt_of(batch["input_ids"][b], batch["loss_mask"][b], batch["attention_mask"][b])
                for b in range(batch["input_ids"].shape[0])]

    def decode(self, prompts: list[list[int]]) -> tuple[list[Rollout], RolloutReport]:
        """Rollouts of ``prompts`` with the current weights, in the target's own precision."""
        was_training = self.draft.training
        device = next(self.draft.parameters()).device  # any base's draft, not one with a named layer
        try:
            with torch.autocast(device.type, enabled=False), closing(self.drafter_factory(self.draft)) as drafter:
                return rollout(self.target, drafter, prompts, self.generation, vocab_ids=self.vocab_ids(),
                               rejected_suffix=self.rejected_suffix, max_prompt_tokens=self.max_prompt_tokens)
        finally:
            self.draft.train(was_training)

    def _random_anchors(self, ro: Rollout, gen: torch.Generator) -> list[Anchor]:
        """As many anchors as ``ro`` has, at random response positions, replaying the committed tokens."""
        T = int(ro.tokens.shape[0])
        with torch.no_grad(), torch.autocast(ro.tokens.device.type, enabled=False):
            logits = self.target.forward(ro.tokens[None].to(self.target.device)).logits[0]  # [T, V]
        logp = torch.log_softmax(logits.float(), -1).index_select(-1, self.vocab_ids().to(logits.device)).cpu()
        out = []
        for a in ro.anchors:
            K = min(a.length, T - 1 - ro.prompt_len)
            if K < 1:
                continue
            root = ro.prompt_len + int(torch.randint(0, T - K - ro.prompt_len, (1,), generator=gen))
            nxt = root + K + 1
            out.append(Anchor(root=root, chain=ro.tokens[root + 1: root + 1 + K].clone(), accepted=K,
                              target_logprobs=logp[root: root + K].clone(), rejected=[],
                              committed=int(ro.tokens[nxt]) if nxt < T else -1))
        return out

    def _round_anchors(self, ro: Rollout, gen: torch.Generator) -> list[Anchor]:
        """As many anchors as ``ro`` has (its rounds that proposed something), at distinct random response
        positions, each a verification round of the rollout drafter from that position of ``ro``."""
        T = int(ro.tokens.shape[0])
        # A root needs a committed next token: roots lie in [prompt_len, T - 2], as the rollout's own do.
        room = T - 1 - ro.prompt_len
        M = min(len(ro.anchors), room)
        if M < 1:
            return []
        positions = (ro.prompt_len + torch.randperm(room, generator=gen)[:M]).tolist()
        # At T > 0 the rounds draw their verification outcomes; their generator follows the positions' one,
        # so a phase recomputed after a resume draws the same.
        sampling = (None if self.generation.temperature == 0
                    else torch.Generator(device=self.target.device).manual_seed(
                        int(torch.randint(0, 2**62, (1,), generator=gen))))  # verify draws where the logits are
        was_training = self.draft.training
        device = next(self.draft.parameters()).device
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False), \
                    closing(self.drafter_factory(self.draft)) as drafter:
                traces = rounds_at(self.target, drafter, ro.tokens.tolist(), ro.prompt_len, positions,
                                   self.generation, generator=sampling)
        finally:
            self.draft.train(was_training)
        vocab = self.vocab_ids()
        anchors = (round_anchor(t, vocab_ids=vocab, rejected_suffix=self.rejected_suffix) for t in traces)
        return [a for a in anchors if a is not None]

    def start_phase(self, phase: int, batch: dict[str, torch.Tensor]) -> RolloutReport:
        rollouts, report = self.decode(self._prompts(batch))
        if self.anchor_rule in ("random", "random_rounds"):
            # Seeded by (seed, phase): a phase recomputed after a resume places the same anchors.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + phase)
            make = self._random_anchors if self.anchor_rule == "random" else self._round_anchors
            rollouts = [Rollout(r.tokens, r.prompt_len, make(r, gen)) for r in rollouts]
        self.buffer = [r for r in rollouts if r.anchors]
        self.buffer_phase = phase
        self._features = {}
        self.log_dict({"opd/rollout_tau": report.tau, "opd/rollout_success": float(report.success),
                       "opd/rollout_error": float(report.error), "opd/rollout_skipped": float(report.skipped),
                       "opd/rollout_anchors": float(sum(r.rounds for r in self.buffer))}, batch_size=1)
        return report

    # ---- replay -------------------------------------------------------------------------------------------

    def _chosen(self, phase: int, step_in_phase: int) -> list[int]:
        n = len(self.buffer)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + phase)
        order = torch.randperm(n, generator=gen).tolist()
        start = step_in_phase * self.sequences_per_step
        return [order[(start + j) % n] for j in range(min(self.sequences_per_step, n))]

    def replay_batch(self, indices: list[int]) -> ReplayBatch:
        """The chosen rollouts' anchors replayed with gradients, padded to one batch of positions."""
        vocab = self.vocab_ids()
        to_draft = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
        to_draft[vocab] = torch.arange(vocab.numel())

        def draft_id(token: int) -> int:
            return int(to_draft[token]) if 0 <= token < to_draft.numel() else -1

        K = max(a.length for i in indices for a in self.buffer[i].anchors)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("q", "p", "valid", "acc", "com", "rej")}
        for i in indices:
            ro = self.buffer[i]
            if i not in self._features:
                self._features[i] = self.replay.features(self.draft, self.target, ro.tokens)
            M = len(ro.anchors)
            chains = torch.zeros(M, K, dtype=torch.long)
            logp = torch.zeros(M, K, vocab.numel())
            valid = torch.zeros(M, K, dtype=torch.bool)
            acc = torch.zeros(M, K, dtype=torch.bool)
            com = torch.full((M, K), -1, dtype=torch.long)
            S = max([len(a.rejected) for a in ro.anchors] + [1])
            rej = torch.full((M, K, S), -1, dtype=torch.long)
            for m, a in enumerate(ro.anchors):
                n, r = a.length, a.accepted
                chains[m, :n], logp[m, :n], valid[m, :n], acc[m, :r] = a.chain, a.target_logprobs.float(), True, True
                com[m, :r] = torch.tensor([draft_id(t) for t in a.chain[:r].tolist()], dtype=torch.long)
                if r < n:
                    com[m, r] = draft_id(a.committed)
                    ids = [draft_id(t) for t in a.rejected][:S]
                    rej[m, r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    for k in range(r + 1, n):
                        rej[m, k, 0] = draft_id(int(a.chain[k]))
            roots = torch.tensor([a.root for a in ro.anchors], dtype=torch.long)
            parts["q"].append(self.replay.logprobs(self.draft, self.target, ro.tokens, roots, chains,
                                                   features=self._features[i]))
            for key, t in (("p", logp), ("valid", valid), ("acc", acc), ("com", com), ("rej", rej)):
                parts[key].append(t)
        width = max(t.shape[-1] for t in parts["rej"])
        parts["rej"] = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1) for t in parts["rej"]]
        device = parts["q"][0].device
        cat = {k: torch.cat(v).to(device) for k, v in parts.items()}
        return ReplayBatch(cat["q"], cat["p"], cat["valid"], cat["acc"], cat["com"], cat["rej"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int):
        phase, step_in_phase = divmod(self.steps_done, self.refresh_every)
        self.steps_done += 1
        if phase != self.buffer_phase:
            self.start_phase(phase, batch)
        if not self.buffer:
            return None  # nothing decoded in this phase (every prompt skipped or failed): no update
        rb = self.replay_batch(self._chosen(phase, step_in_phase))
        loss, stats = self.objective(rb)
        logs = {"train/loss": loss.detach(), "opd/loss": loss.detach(), "opd/fwd_term": stats["fwd_term"],
                "opd/rev_term": stats["rev_term"], "opd/accepted": stats["accepted"].float(),
                "opd/rejected": stats["rejected"].float()}
        fwd, rev = rb.valid & rb.accepted, rb.valid & ~rb.accepted
        for k in range(rb.valid.shape[1]):
            logs[f"opd/accepted_{k + 1}"] = fwd[:, k].sum().float()
            logs[f"opd/rejected_{k + 1}"] = rev[:, k].sum().float()
        self.log_dict(logs, batch_size=int(rb.valid.shape[0]))
        return loss

    # ---- validation: held-out rollouts --------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self._val = RolloutReport()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, report = self.decode(self._prompts(batch))
        v = self._val
        for name in ("prompts", "success", "error", "skipped", "new_tokens", "rounds"):
            setattr(v, name, getattr(v, name) + getattr(report, name))

    def on_validation_epoch_end(self) -> None:
        if self._val is not None and self._val.rounds:
            self.log_dict({"val/tau": self._val.tau, "val/rollout_tokens": float(self._val.new_tokens)})
        self._val = None

    # ---- optimisation and checkpoints ---------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        return configure(self, params, self.optimizer_factory, self.schedule_factory, self.total_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.base_module.on_save_checkpoint(checkpoint)
        checkpoint["draft_opd"] = {"steps_done": self.steps_done, "buffer_phase": self.buffer_phase,
                                   "buffer": [_rollout_state(r) for r in self.buffer]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.base_module.on_load_checkpoint(checkpoint)
        state = checkpoint.get("draft_opd")
        if state is not None:
            self.steps_done, self.buffer_phase = int(state["steps_done"]), int(state["buffer_phase"])
            self.buffer = [_rollout_from_state(s) for s in state["buffer"]]
            self._features = {}


# Plain containers of tensors and numbers, so checkpoints load with torch's weights_only reader.
def _rollout_state(r: Rollout) -> dict:
    return {"tokens": r.tokens, "prompt_len": r.prompt_len,
            "anchors": [{"root": a.root, "chain": a.chain, "accepted": a.accepted, "target_logprobs": a.target_logprobs,
                         "rejected": list(a.rejected), "committed": a.committed} for a in r.anchors]}


def _rollout_from_state(s: dict) -> Rollout:
    return Rollout(s["tokens"], int(s["prompt_len"]), [Anchor(**a) for a in s["anchors"]])
