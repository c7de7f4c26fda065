"""The decoding loop: prefill, then rounds of propose -> pass -> verify -> commit -> update.

Each round the drafter proposes a tree, one target pass (``VerifyPass``, built once per round: the tree
rows, the drafter's extra rows and the ``PassRequest`` of what else to compute) scores it, the verifier
picks the accepted path, the cache and sequence keep it, and the drafter absorbs the outcome. One loop for every method. Lossless by construction: the only thing that decides which tokens are emitted
is ``verify``, whose greedy rule reproduces argmax decoding and whose sampling rules reproduce the target
distribution. The AR baseline at the bottom uses the same cache, target forward and sampling code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from draftlab.decoding.drafter import DecodeState, Drafter, ExtraOutput, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.decoding.verify import VerifyResult, verify
from draftlab.targets.base import PassRequest, TargetOutput


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_on_eos: bool = True
    # Scratch room past the context for the largest verify pass (tree nodes + extra rows); ``scratch_for``
    # raises it to ``drafter.scratch_rows(cfg)`` when the drafter declares more.
    scratch_rows: int = 128


@dataclass
class RoundTrace:
    """One round as on-policy training consumes it (``speculative_generate(..., trace=True)``).

    Node i sits at sequence position ``anchor + depth[i]`` (the root at ``anchor``, the committed target
    length before the round), so ``target_logprobs[i]`` is the target's distribution of the token at
    position ``anchor + depth[i] + 1``. They are ``log_softmax`` of the very logits the verifier used (no
    extra pass); ``logits_to_probs(target_logprobs, temperature, top_k, top_p)`` is the verify distribution.
    """

    anchor: int
    tokens: torch.Tensor  # [N] node 0 = root
    parents: torch.Tensor  # [N]
    draft_probs: torch.Tensor | None  # [N, V] as the drafter proposed them (None when it gave none)
    deterministic: bool  # which acceptance rule verified the tree
    target_logprobs: torch.Tensor  # [N, V] CPU, float32 unless asked otherwise
    path: list[int]
    rejected: list[int]
    bonus: int
    kept: int  # tokens emitted this round: path[1:] tokens then the bonus, cut to ``kept``

    @property
    def emitted(self) -> list[int]:
        toks = self.tokens.tolist()
        return ([toks[i] for i in self.path[1:]] + [self.bonus])[: self.kept]


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
    trace: list[RoundTrace] | None = None  # per round, with ``trace=True``; not part of ``as_dict``
    drafter_stats: dict | None = None  # the drafter's own numbers for this sequence (``Drafter.sequence_stats``)

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
                "tokens_per_second": self.tokens_per_second, "drafter_stats": self.drafter_stats}


def _generator(cfg: GenerationConfig, device: torch.device) -> torch.Generator | None:
    # On the target's device: the verifier draws its coins and bonus tokens where the logits are, and a
    # generator on another device is refused there (a CPU generator with CUDA logits raises).
    if cfg.temperature == 0 or cfg.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(cfg.seed)


def scratch_for(cfg: GenerationConfig, drafter: Drafter | None = None) -> int:
    """Cache rows past the context a sequence reserves for its largest verify pass: ``cfg.scratch_rows``,
    raised to what the drafter declares (``Drafter.scratch_rows``). The only place scratch is sized."""
    declared = drafter.scratch_rows(cfg) if drafter is not None else None
    return max(cfg.scratch_rows, int(declared or 0))


def pass_request(target, drafter: Drafter) -> PassRequest:
    """What every pass of a sequence computes for ``drafter`` besides logits: its aux taps and attention mass.

    A drafter that asks for neither gets a plain request, so targets without those features (stubs) work."""
    taps = drafter.taps(target)
    mass_rows = drafter.attention_rows()
    return PassRequest(aux=list(taps) if taps else False, attn_mass_rows=int(mass_rows) if mass_rows else 0)


def _mass(out, rows: int) -> torch.Tensor | None:
    """The attention mass of a pass's output ``[L, Hkv, S]`` (batch 1) when the drafter asked for it."""
    if not rows:
        return None
    if out.attn_mass is None:
        raise RuntimeError("the drafter asks for attention_rows, but the verify pass returned no attn_mass "
                           "(a drafter's verify_forward must ask the target for PassRequest.attn_mass_rows)")
    return out.attn_mass[:, 0]


def _prefill(target, prompt_ids: list[int], capacity: int, base: PassRequest):
    cache = target.new_cache(1, capacity)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)  # [1, P]
    last = torch.tensor([len(prompt_ids) - 1], device=target.device)  # only the last row's logits are sampled
    out = target.forward(ids, None, cache, None, replace(base, logits_rows=last))
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


@dataclass
class VerifyPass:
    """One round's target pass, built once per round: which rows run, where, what they see, what comes back.

    Rows ``[0, n)`` are the tree's nodes, rows ``[n, n + R)`` the drafter's extra rows (``ExtraRows``)."""

    ids: torch.Tensor | None  # [1, N] tree tokens; None when extra rows make it ``request.input_embeds``
    positions: torch.Tensor  # [N + R] past + depth for tree rows, the extra rows' own
    mask: torch.Tensor  # bool [N + R, past + N + R]
    request: PassRequest  # the sequence's taps / mass rows, plus the extra rows' embeds, logits, pinned rows
    past: int  # committed length before the pass: the root's position
    n: int
    extra: ExtraRows | None = None

    def run(self, target, cache) -> TargetOutput:
        return target.forward(self.ids, self.positions, cache, self.mask, self.request)

    def extra_output(self, vout: TargetOutput) -> ExtraOutput | None:
        """The target's outputs at the extra rows, typed for ``Drafter.update``."""
        if self.extra is None:
            return None
        n = self.n
        return ExtraOutput(logits=vout.logits[0, n:] if self.extra.want_logits else None,  # [R, V]
                           aux=vout.aux_hidden[0, n:] if vout.aux_hidden is not None else None,  # [R, n_aux*d]
                           hidden=vout.last_hidden[0, n:] if self.extra.want_hidden else None)  # [R, d]


def verify_pass(target, tree: DraftTree, extra: ExtraRows | None, past: int, base: PassRequest,
                scratch: int | None = None) -> VerifyPass:
    """The verify pass of ``tree`` (plus ``extra`` rows) over ``past`` committed rows; ``scratch``: the rows
    the cache reserves, which the pass may not exceed."""
    device, n = target.device, tree.size
    # Each node sees the whole committed prefix plus its own ancestors; position = past + depth.
    tree_mask = ancestor_mask(tree.parents).to(device)  # [N, N]
    ids = tree.tokens.to(device)[None]  # [1, N]
    pos = past + tree.depth.to(device)  # [N]
    rows = n + (extra.num_rows if extra is not None else 0)
    if scratch is not None and rows > scratch:
        raise RuntimeError(f"a verify pass of {rows} rows (tree {n} + extra {rows - n}) exceeds the {scratch} "
                           "scratch rows reserved: declare them in Drafter.scratch_rows or raise "
                           "GenerationConfig.scratch_rows")
    if extra is None:
        mask = torch.cat([tree_mask.new_ones(n, past), tree_mask], 1)  # [N, past + N]
        return VerifyPass(ids, pos, mask, base, past, n)
    r = extra.num_rows
    tree_mask = torch.cat([torch.cat([tree_mask, tree_mask.new_zeros(n, r)], 1), extra.tree_mask.to(device)], 0)
    mask = torch.cat([tree_mask.new_ones(rows, past), tree_mask], 1)  # [N + R, past + N + R]
    if extra.sees_prefix is not None:
        mask[n:, :past] = extra.sees_prefix.to(device)[:, None]
    embeds = torch.cat([target.embed(ids)[0], extra.embeds.to(device)], 0)[None]  # [1, N + R, d]
    request = replace(base, input_embeds=embeds, last_hidden=extra.want_hidden,
                      # no LM head over the extra rows unless the drafter reads their logits
                      logits_rows=None if extra.want_logits else torch.arange(n, device=device),
                      pinned=extra.pinned,
                      pinned_mask=_pinned_mask(extra, n, device) if extra.pinned is not None else None)
    return VerifyPass(None, torch.cat([pos, extra.position_ids.to(device)]), mask, request, past, n, extra)


def _pinned_mask(extra: ExtraRows, n: int, device) -> torch.Tensor:
    """bool [N + R, P]: the extra rows see the pinned rows they ask for, the N tree rows none."""
    P = extra.pinned.num_rows
    rows = (extra.pinned_mask.to(device=device, dtype=torch.bool) if extra.pinned_mask is not None
            else torch.ones(extra.num_rows, P, dtype=torch.bool, device=device))  # [R, P]
    return torch.cat([rows.new_zeros(n, P), rows], 0)


def run_verify_pass(target, drafter: Drafter, state: DecodeState, tree: DraftTree, vpass: VerifyPass) -> TargetOutput:
    """The round's pass: the drafter's own ``verify_forward`` when it has one (never with extra rows), else
    ``target.forward`` over ``vpass``."""
    vout = drafter.verify_forward(state, tree) if vpass.extra is None else None
    if vout is None:
        return vpass.run(target, state.cache)
    if vpass.request.aux and vout.aux_hidden is None:
        raise RuntimeError("the drafter's verify_forward returned no aux states for the layers it taps")
    return vout


def commit_round(state: DecodeState, vpass: VerifyPass, vout: TargetOutput, tree: DraftTree, result: VerifyResult,
                 kept: list[int], rows: list[int] | None = None) -> VerifyOutput:
    """Commit the verified path's tree ``rows`` (default: all of ``result.path``, root first) to the cache and
    ``kept`` (the emitted tokens) to the sequence; what the drafter's ``update`` reads."""
    n = vpass.n
    rows = result.path if rows is None else rows
    state.cache.commit_rows(rows)  # root + accepted nodes; the bonus token is next round's root
    state.tokens.extend(kept)
    aux = vout.aux_hidden[0, :n] if vout.aux_hidden is not None else None  # [N, n_aux*d]
    # Only rows whose tokens were kept (a round cut at EOS / the budget keeps a prefix of the path).
    state.accepted_aux = aux[rows[:len(kept)]] if aux is not None else None  # [kept, n_aux*d]
    state.attn_mass = _mass(vout, vpass.request.attn_mass_rows)  # [L, Hkv, past + N]
    return VerifyOutput(tree=tree, result=result, logits=vout.logits[0, :n], aux=aux,
                        accepted_aux=state.accepted_aux, extra=vpass.extra_output(vout), kept=len(kept),
                        attn_mass=state.attn_mass)


def round_trace(anchor: int, tree: DraftTree, logits: torch.Tensor, result: VerifyResult, kept: int,
                 dtype: torch.dtype) -> RoundTrace:
    return RoundTrace(anchor=anchor, tokens=tree.tokens.cpu(), parents=tree.parents.cpu(),
                      draft_probs=None if tree.draft_probs is None else tree.draft_probs.to("cpu", dtype),
                      deterministic=bool(tree.deterministic),
                      target_logprobs=torch.log_softmax(logits.float(), -1).to("cpu", dtype),  # [N, V]
                      path=list(result.path), rejected=list(result.rejected), bonus=result.bonus_token, kept=kept)


def start_sequence(target, prompt_ids: list[int], drafter: Drafter, cfg: GenerationConfig, gen, base: PassRequest,
                   scratch: int, *, root: int | None = None, capacity: int | None = None) -> DecodeState:
    """Prefill, take the first token, hand the drafter its first state (``reset``): the engine's first step.

    ``root``: the first token when it is already known (a committed sequence being replayed), else drawn from
    the prefill's last row. ``capacity``: cache rows (default: the prompt, the token budget and ``scratch``)."""
    capacity = capacity if capacity is not None else len(prompt_ids) + cfg.max_new_tokens + scratch
    cache, out = _prefill(target, prompt_ids, capacity, base)
    if root is None:
        root = int(sample(logits_to_probs(out.logits[0, -1], cfg.temperature, cfg.top_k, cfg.top_p), gen))
    state = DecodeState(target=target, cache=cache, tokens=list(prompt_ids) + [root], prompt_len=len(prompt_ids),
                        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, generator=gen,
                        accepted_aux=out.aux_hidden[0] if out.aux_hidden is not None else None,  # [P, n_aux*d]
                        attn_mass=_mass(out, base.attn_mass_rows))  # [L, Hkv, P]
    drafter.reset(state)  # a feature drafter runs its first pass here: part of the prefill cost
    return state


def _record_round(stats: DecodeStats, kept: int, nodes: int, t0: float, t1: float, t2: float, t3: float) -> None:
    stats.accept_lengths.append(kept)
    # Drafting = proposing this round's tree + absorbing its outcome (a draft pass over accepted rows).
    stats.draft_times.append((t1 - t0) + (t3 - t2))
    stats.verify_times.append(t2 - t1)
    stats.tree_sizes.append(nodes)


@torch.no_grad()
def speculative_generate(target, prompt_ids: list[int], drafter: Drafter | None = None,
                         cfg: GenerationConfig | None = None, *, trace: bool = False,
                         trace_dtype: torch.dtype = torch.float32) -> tuple[list[int], DecodeStats]:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``; returns (new tokens, stats).

    With ``trace``, ``stats.trace`` holds one ``RoundTrace`` per round (tree, draft and target
    distributions, accepted path, rejected nodes, bonus, kept), taken from the verify pass itself.
    """
    cfg, drafter = cfg or GenerationConfig(), drafter or NoDrafter()
    eos = set(target.eos_token_ids)
    stats = DecodeStats(trace=[] if trace else None)
    t_start = time.perf_counter()
    gen = _generator(cfg, target.device)
    base = pass_request(target, drafter)  # what every pass computes for the drafter (taps, attention mass)
    scratch = scratch_for(cfg, drafter)
    state = start_sequence(target, prompt_ids, drafter, cfg, gen, base, scratch)
    new: list[int] = [state.root]
    stats.prefill_time = time.perf_counter() - t_start
    while len(new) < cfg.max_new_tokens and not (cfg.stop_on_eos and new[-1] in eos):
        t0 = time.perf_counter()
        tree = drafter.propose(state)  # N nodes, node 0 = the last committed token
        t1 = time.perf_counter()
        vpass = verify_pass(target, tree, drafter.extra_rows(state, tree), state.cache.length, base, scratch)
        vout = run_verify_pass(target, drafter, state, tree, vpass)  # logits [1, N (+ R), V]
        logits = vout.logits[0, :tree.size]  # [N, V]
        result = verify(logits, tree, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, generator=gen)
        t2 = time.perf_counter()
        emitted = result.accepted_tokens(tree)  # accepted path tokens, then the bonus
        kept = emitted[:_stop_index(emitted, eos, cfg.max_new_tokens - len(new), cfg.stop_on_eos)]
        new.extend(kept)
        drafter.update(state, commit_round(state, vpass, vout, tree, result, kept))
        t3 = time.perf_counter()
        if trace:
            stats.trace.append(round_trace(vpass.past, tree, logits, result, len(kept), trace_dtype))
        _record_round(stats, len(kept), tree.size, t0, t1, t2, t3)
    stats.drafter_stats = drafter.sequence_stats()
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
    gen = _generator(cfg, target.device)
    cache, out = _prefill(target, prompt_ids, len(prompt_ids) + cfg.max_new_tokens + scratch_for(cfg), PassRequest())
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
