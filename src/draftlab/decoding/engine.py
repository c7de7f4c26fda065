"""The decoding loop: prefill, then rounds of propose -> verify (one target pass) -> commit.

One loop for every method. Lossless by construction: the only thing that decides which tokens are emitted
is ``verify``, whose greedy rule reproduces argmax decoding and whose sampling rules reproduce the target
distribution. The AR baseline at the bottom uses the same cache, target forward and sampling code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from draftlab.decoding.drafter import DecodeState, Drafter, NoDrafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import ancestor_mask
from draftlab.decoding.verify import verify


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_on_eos: bool = True
    # Scratch room past the context for the largest verify pass (tree nodes + extra rows).
    max_tree_rows: int = 128


@dataclass
class DecodeStats:
    """Per-sequence statistics, returned rather than printed (gpt-fast style)."""

    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per round; counts the bonus token
    draft_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    wall_time: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean accepted length per round (bonus included), as Spec-Bench reports it."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def accept_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "rounds": self.rounds, "tau": self.tau,
                "accept_histogram": self.accept_histogram, "accept_lengths": self.accept_lengths,
                "draft_time": sum(self.draft_times), "verify_time": sum(self.verify_times),
                "prefill_time": self.prefill_time, "wall_time": self.wall_time,
                "tokens_per_second": self.tokens_per_second}


def _generator(cfg: GenerationConfig) -> torch.Generator | None:
    if cfg.temperature == 0 or cfg.seed is None:
        return None
    return torch.Generator().manual_seed(cfg.seed)


def _prefill(target, prompt_ids: list[int], cfg: GenerationConfig, need_aux: bool):
    cache = target.new_cache(1, len(prompt_ids) + cfg.max_new_tokens + cfg.max_tree_rows)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)  # [1, P]
    out = target.forward(ids, cache=cache, return_aux=need_aux,
                         logits_rows=torch.tensor([len(prompt_ids) - 1], device=target.device))
    cache.commit(len(prompt_ids))
    return cache, out


def _stop_index(tokens: list[int], eos: set[int], budget: int, stop_on_eos: bool) -> int:
    """How many of ``tokens`` to keep: up to and including the first EOS, and at most ``budget``."""
    n = min(len(tokens), budget)
    if stop_on_eos:
        for i, t in enumerate(tokens[:n]):
            if t in eos:
                return i + 1
    return n


@torch.no_grad()
def speculative_generate(target, prompt_ids: list[int], drafter: Drafter | None = None,
                         cfg: GenerationConfig | None = None) -> tuple[list[int], DecodeStats]:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``; returns (new tokens, stats)."""
    cfg = cfg or GenerationConfig()
    drafter = drafter or NoDrafter()
    eos = set(target.eos_token_ids)
    stats = DecodeStats()
    t_start = time.perf_counter()
    gen = _generator(cfg)
    cache, out = _prefill(target, prompt_ids, cfg, drafter.needs_aux)
    root = int(sample(logits_to_probs(out.logits[0, -1], cfg.temperature, cfg.top_k, cfg.top_p), gen))
    stats.prefill_time = time.perf_counter() - t_start
    new: list[int] = [root]
    state = DecodeState(target=target, cache=cache, tokens=list(prompt_ids) + [root], prompt_len=len(prompt_ids),
                        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, generator=gen,
                        accepted_aux=out.aux_hidden[0] if out.aux_hidden is not None else None)
    drafter.reset(state)  # a feature drafter runs its first pass here: part of the prefill cost
    stats.prefill_time = time.perf_counter() - t_start
    device = target.device
    while len(new) < cfg.max_new_tokens and not (cfg.stop_on_eos and new[-1] in eos):
        t0 = time.perf_counter()
        tree = drafter.propose(state)
        t1 = time.perf_counter()
        n = tree.size
        extra = drafter.extra_rows(state, tree) if hasattr(drafter, "extra_rows") else None
        past = cache.length
        # Each node sees the whole committed prefix plus its own ancestors; position = past + depth.
        tree_mask = ancestor_mask(tree.parents).to(device)  # [N, N]
        ids = tree.tokens.to(device)[None]  # [1, N]
        pos = past + tree.depth.to(device)  # [N]
        embeds = None
        if extra is not None:
            r = extra.embeds.shape[0]
            tree_mask = torch.cat([torch.cat([tree_mask, tree_mask.new_zeros(n, r)], 1), extra.tree_mask.to(device)], 0)
            embeds = torch.cat([target.model.get_input_embeddings()(ids)[0], extra.embeds.to(device)], 0)[None]
            pos = torch.cat([pos, extra.position_ids.to(device)])
        rows = tree_mask.shape[0]
        mask = torch.cat([tree_mask.new_ones(rows, past), tree_mask], 1)  # [rows, past + rows]
        if extra is not None and extra.sees_prefix is not None:
            mask[n:, :past] = extra.sees_prefix.to(device)[:, None]
        vout = target.forward(ids if embeds is None else None, pos, cache, mask, return_aux=drafter.needs_aux,
                              input_embeds=embeds)
        result = verify(vout.logits[0, :n], tree, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        generator=gen)
        t2 = time.perf_counter()
        accepted = result.accepted_tokens(tree)
        keep = _stop_index(accepted, eos, cfg.max_new_tokens - len(new), cfg.stop_on_eos)
        accepted = accepted[:keep]
        cache.commit_rows(result.path)  # root + accepted nodes; the bonus token is next round's root
        new.extend(accepted)
        state.tokens.extend(accepted)
        if drafter.needs_aux:
            # Only rows whose tokens were kept (a round cut at EOS / the budget keeps a prefix of the path).
            state.accepted_aux = vout.aux_hidden[0, result.path[: len(accepted)]]  # [kept, n_aux*d]
        if extra is not None:
            state.extra_out = (vout, n)
        drafter.update(state, result, tree)
        t3 = time.perf_counter()
        stats.accept_lengths.append(len(accepted))
        # Drafting = proposing this round's tree + absorbing its outcome (a draft pass over accepted rows).
        stats.draft_times.append((t1 - t0) + (t3 - t2))
        stats.verify_times.append(t2 - t1)
        stats.tree_sizes.append(n)
    stats.new_tokens = len(new)
    stats.wall_time = time.perf_counter() - t_start
    return new, stats


@torch.no_grad()
def autoregressive_generate(target, prompt_ids: list[int], cfg: GenerationConfig | None = None
                            ) -> tuple[list[int], DecodeStats]:
    """The baseline: one target step per token, same cache, forward and sampling code as the engine."""
    cfg = cfg or GenerationConfig()
    eos = set(target.eos_token_ids)
    stats = DecodeStats()
    t_start = time.perf_counter()
    gen = _generator(cfg)
    cache, out = _prefill(target, prompt_ids, cfg, False)
    tok = int(sample(logits_to_probs(out.logits[0, -1], cfg.temperature, cfg.top_k, cfg.top_p), gen))
    stats.prefill_time = time.perf_counter() - t_start
    new = [tok]
    step = torch.empty(1, 1, dtype=torch.long, device=target.device)
    while len(new) < cfg.max_new_tokens and not (cfg.stop_on_eos and tok in eos):
        t0 = time.perf_counter()
        step.fill_(tok)
        logits = target.forward(step, None, cache).logits[0, -1]  # [V]
        cache.commit(1)
        tok = int(sample(logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), gen))
        new.append(tok)
        stats.verify_times.append(time.perf_counter() - t0)
        stats.accept_lengths.append(1)
    stats.new_tokens = len(new)
    stats.wall_time = time.perf_counter() - t_start
    return new, stats
