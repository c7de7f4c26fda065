"""EAGLE-3 as an ``OutcomeDrafter``: drafting after a sequence whose tail the target has not verified yet.

An EAGLE-3 draft reads the target's features of every committed token, and the features of a token the
target is still verifying (or of a hypothetical bonus token) do not exist yet. What the draft does have is
what test-time training taught it to consume: its own output state. So past the last verified row this
outcome drafter drafts exactly as a tree grows past the root -- each row consumes a token and the output state of
the row before it (``drafter.py``'s module docstring) -- whether that token is a chain token being glued, a
bonus candidate or a drafted one.

The verified part comes in through ``absorb(verified(state))``: the tokens and the target's features of the
rows committed in the last round (every round, so a copy in another process stays in step), from which the
committed draft rows are computed as ``Eagle3Drafter.update`` computes them. Drafting rows are provisional:
each ``chain`` / ``glue`` drops the previous ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from draftlab.decoding.outcome_drafter import OutcomeChain, Reshape, Sampling, draw_branches
from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.draft_cache import DraftRows
from draftlab.methods.eagle3.model import Eagle3Draft


class Eagle3OutcomeDrafter:
    """A draft (its own ``DraftRows`` cache) drafting after the verified sequence it absorbed, on its own states
    past it (module docstring)."""

    def __init__(self, draft: Eagle3Draft, *, chunk: int = 256):
        self.rows = DraftRows(draft.eval(), chunk=chunk)
        self.tokens: list[int] = []  # the verified sequence the committed rows account for
        # After ``glue``: the output state after the context and after each chain token ([K+1] x [d]), and the
        # provisional slots of the context's unverified tail and of the chain, in order.
        self._glued: tuple[list[torch.Tensor], list[int], int] | None = None

    # ---- the verified sequence ---------------------------------------------------------------------------

    @staticmethod
    def verified(state) -> tuple[list[int], torch.Tensor]:
        """What a copy needs of the verified sequence ``state`` (after prefill, or after a round): its tokens
        and the target's features of the rows committed last (``state.accepted_aux``, ``[n, 3*d_t]``)."""
        if state.accepted_aux is None:
            raise ValueError("an EAGLE-3 outcome drafter needs the target's aux states: its owner must tap taps(target)")
        return list(state.tokens), state.accepted_aux.detach()

    def absorb(self, verified: tuple[list[int], torch.Tensor]) -> None:
        """Commit the draft rows of the newly verified tokens (a fresh cache when ``verified`` is a prompt)."""
        tokens, aux = verified
        n = int(aux.shape[0])
        first = len(tokens) - 1 - n  # the row the first of them belongs to
        rows = self.rows
        if first == 0:
            rows.start(n)
        elif rows.cache is None or self.tokens != tokens[: first + 1]:
            raise RuntimeError(f"verified rows from {first} arrive, but this outcome drafter holds a different sequence "
                               f"of {len(self.tokens)} tokens: absorb every round's verified(state)")
        rows.rollback()
        self._glued = None
        rows.append(tokens[first + 1:], aux)
        self.tokens = list(tokens)

    # ---- provisional rows --------------------------------------------------------------------------------

    def _run(self, ids: list[int], hidden: torch.Tensor, positions: list[int], sees: list[list[int]]
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Provisional rows consuming ``ids [R]`` with fed-back states ``hidden [R, d]`` at ``positions``; row r
        attends to the committed rows, the provisional slots ``sees[r]`` and itself. Returns (states [R, d],
        log-probs over the target vocabulary [R, V], the rows' slots)."""
        rows, dev = self.rows, self.rows.device
        r = len(ids)
        rows.reserve(r)
        past = rows.cache.length
        slots = list(range(past, past + r))
        mask = torch.zeros(r, past + r, dtype=torch.bool, device=dev)  # [R, S]
        mask[:, : rows.committed] = True
        pairs = [(i, c) for i, seen in enumerate(sees) for c in [*seen, slots[i]]]
        mask[torch.tensor([i for i, _ in pairs], device=dev), torch.tensor([c for _, c in pairs], device=dev)] = True
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)  # [R]
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)  # [R]
        h, logp = rows.step(ids_t, hidden, pos_t, mask)  # [R, d], [R, V_d]
        rows.cache.commit(r)  # provisional: ``rollback`` drops them
        return h, rows.to_full_vocab(logp), slots

    def _follow(self, context: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Drop earlier drafting rows and run ``context``'s unverified tail; returns (the state after it [d], the
        log-probs of the next token [V], the tail's slots)."""
        m = len(self.tokens)
        if self.rows.cache is None or context[:m] != self.tokens or len(context) < m:
            raise ValueError(f"an EAGLE-3 outcome drafter drafts after the verified sequence it absorbed ({m} tokens) "
                             "and its continuations; absorb(verified(state)) first")
        self.rows.rollback()
        self._glued = None
        h, logp, slots = self.rows.h_last, self.rows.root_logprobs, []
        for i, tok in enumerate(context[m:]):
            out, lp, new = self._run([tok], h[None], [m - 1 + i], [list(slots)])
            h, logp, slots = out[0], lp[0], slots + new
        return h, logp, slots

    # ---- the OutcomeDrafter protocol -------------------------------------------------------------------------

    @torch.no_grad()
    def chain(self, context: list[int], depth: int, sampling: Sampling, reshape: Reshape | None = None
              ) -> OutcomeChain:
        h, z, seen = self._follow(context)
        tokens, probs = [], []
        for j in range(depth):
            tok, q = sampling.draw(z, reshape, j)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if j + 1 < depth:  # the row consuming the last token is never read
                out, lp, new = self._run([tok], h[None], [len(context) - 1 + j], [seen])
                h, z, seen = out[0], lp[0], seen + new
        return OutcomeChain(tokens, torch.stack(probs) if probs else None)

    @torch.no_grad()
    def glue(self, context: list[int], chain: list[int]) -> torch.Tensor:
        """Log-probs ``[K+1, V]`` after ``context`` and after each chain token (the chain run on the draft's own
        states, one row per token: each needs the state of the one before)."""
        h, z, seen = self._follow(context)
        states, logps = [h], [z]
        for j, tok in enumerate(chain):
            out, lp, new = self._run([tok], h[None], [len(context) - 1 + j], [seen])
            h, seen = out[0], seen + new
            states.append(h)
            logps.append(lp[0])
        self._glued = (states, seen, len(context))
        return torch.stack(logps)

    @torch.no_grad()
    def branches(self, starts: list[tuple[int, int]], depth: int, sampling: Sampling,
                 reshape: Reshape | None = None, stop: Callable[[], bool] | None = None) -> list[OutcomeChain] | None:
        """After ``glue``: per ``(j, t)`` a chain after ``context + chain[:j] + [t]``; one pass of ``len(starts)``
        rows per step, branch b's row fed the state of the row before it in its own branch."""
        if self._glued is None:
            raise RuntimeError("branches without a glue pass")
        states, glued, n = self._glued
        tail = len(glued) - (len(states) - 1)  # provisional rows of the context before the chain's
        if not starts or depth == 0:
            return [OutcomeChain([], None) for _ in starts]
        if max(j for j, _ in starts) >= len(states):
            raise ValueError(f"a branch starts after position {max(j for j, _ in starts)}, the glued chain has "
                             f"{len(states) - 1} tokens")
        hidden = torch.stack([states[j] for j, _ in starts])  # [B, d]
        sees = [glued[: tail + j] for j, _ in starts]
        positions = [n - 1 + j for j, _ in starts]

        def step(tokens: list[int]) -> torch.Tensor:
            nonlocal hidden, sees, positions
            hidden, z, slots = self._run(tokens, hidden, positions, sees)  # [B, d], [B, V]
            sees = [seen + [slot] for seen, slot in zip(sees, slots)]
            positions = [p + 1 for p in positions]
            return z

        return draw_branches(step, [t for _, t in starts], depth, sampling, reshape, stop)

    def portable(self):
        """A picklable factory of an independent copy (the draft's weights cloned, its config)."""
        draft = self.rows.draft
        state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        head = draft.lm_head.weight.dtype
        return partial(_rebuild, draft.config.to_dict(), state, head, self.rows.chunk)


def _rebuild(config: dict, state: dict, head_dtype: torch.dtype, chunk: int) -> Eagle3OutcomeDrafter:
    draft = Eagle3Draft(Eagle3Config.from_dict(config))
    draft.to(device=state["fc.weight"].device, dtype=state["fc.weight"].dtype)
    draft.lm_head.to(head_dtype)
    draft.load_state_dict(state)
    return Eagle3OutcomeDrafter(draft.requires_grad_(False), chunk=chunk)
