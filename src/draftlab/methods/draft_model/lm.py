"""A draft language model with its own KV cache: the committed context, then scratch rows at explicit slots.

``DraftLM`` keeps the draft's cache equal to a prefix of the sequence it is asked about: ``sync(context)``
keeps the longest common prefix of what is cached and ``context`` and runs the rest, so a round after a
rejection re-runs only the tokens that changed, and a caller that asks about a different sequence (the SSD
worker's hypothetical outcomes) pays only for where it differs. Drafting writes scratch rows past the
committed length with the mask each row needs (``rows``): a chain, a top-k tree or several branches at once.
Rows of a chain that later turn out to be context are kept instead of re-run (``sync`` checks them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from draftlab.decoding.dynamic_tree import FrontierBatch, build_dynamic_tree
from draftlab.decoding.outcome_drafter import OutcomeChain, Reshape, Sampling, draw_branches
from draftlab.decoding.tree import DraftTree
from draftlab.targets.base import PassRequest
from draftlab.targets.hf import HFTarget


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftLM:
    """A draft model (an ``HFTarget``: the explicit-cache forward) and its KV cache (see the module docstring)."""

    def __init__(self, model: HFTarget, *, initial_length: int = 1024):
        self.model = model
        self.cache = None
        self.context: list[int] = []  # the tokens whose K/V are committed, in order
        self._initial = int(initial_length)
        self._pending: list[int] = []  # tokens of the scratch rows at [length, length + n), a causal chain

    @property
    def length(self) -> int:
        return len(self.context)

    def _ensure(self, rows: int) -> None:
        """Room for ``rows`` slots in all; a grown cache keeps the committed rows (and the pending chain)."""
        old = self.cache
        if old is not None and old.max_length >= rows:
            return
        size = max(rows, self._initial, 2 * (old.max_length if old is not None else 0))
        new = self.model.new_cache(1, size)
        if old is not None:
            keep = old.length + len(self._pending)
            new.k[..., :keep, :] = old.k[..., :keep, :]
            new.v[..., :keep, :] = old.v[..., :keep, :]
            new.length = old.length
        self.cache = new

    def sync(self, context: list[int], spare: int = 64) -> None:
        """Make the committed cache hold exactly ``context`` (with ``spare`` scratch slots after it)."""
        self._ensure(len(context) + spare)
        n = _common_prefix(self.context, context)
        if n < self.length:
            self.cache.truncate(n)
            del self.context[n:]
            self._pending = []
        if self._pending:  # chain rows already computed after the committed context: keep those that match
            m = _common_prefix(self._pending, context[n:])
            if m:
                self.cache.commit(m)
                self.context.extend(self._pending[:m])
                n += m
            self._pending = []
        rest = context[n:]
        if rest:
            ids = torch.tensor([rest], dtype=torch.long, device=self.model.device)  # [1, R]
            self.model.forward(ids, cache=self.cache,
                               request=PassRequest(logits_rows=torch.empty(0, dtype=torch.long, device=ids.device)))
            self.cache.commit(len(rest))
            self.context.extend(rest)

    def rows(self, tokens: list[int], slots: list[int], positions: list[int], sees: list[list[int]]
             ) -> torch.Tensor:
        """Draft logits ``[R, V]`` of rows ``tokens`` written at scratch ``slots`` (>= ``length``), at
        ``positions``; row r attends to the committed context and to the scratch slots ``sees[r]`` (its
        ancestors and itself, all written by now or in this call)."""
        n, dev = self.length, self.model.device
        S = max(max(s) for s in sees) + 1
        self._ensure(S)
        # Built where the draft runs: the mask grows with the context (the committed part is all True).
        rows = torch.tensor([r for r, seen in enumerate(sees) for _ in seen], device=dev)
        cols = torch.tensor([c for seen in sees for c in seen], device=dev)
        mask = torch.zeros(len(tokens), S, dtype=torch.bool, device=dev)  # [R, S]
        mask[:, :n] = True
        mask[rows, cols] = True
        x = self.model.embed(torch.tensor([tokens], dtype=torch.long, device=dev))  # [1, R, d]
        out = self.model.forward_layers(x, 0, self.model.geometry.num_layers, cache=self.cache,
                                        position_ids=torch.tensor(positions, device=dev),
                                        attn_mask=mask, slots=torch.tensor(slots, device=dev))
        return self.model.lm_head(out.hidden)[0].float()  # [R, V]

    def chain(self, context: list[int], depth: int, sampling: Sampling, reshape: Reshape | None = None
              ) -> OutcomeChain:
        """``depth`` tokens drafted one at a time after ``context`` (whose last token is the root)."""
        self.sync(context[:-1], spare=depth + 1)
        n, tok = self.length, context[-1]
        fed, tokens, probs = [], [], []
        for j in range(depth):
            fed.append(tok)
            z = self.rows([tok], [n + j], [n + j], [list(range(n, n + j + 1))])[0]  # [V]
            tok, q = sampling.draw(z, reshape, j)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
        self._pending = fed  # rows [n, n + depth) hold root, x1 .. x_{K-1}
        return OutcomeChain(tokens, torch.stack(probs) if probs else None)

    def glue(self, context: list[int], chain: list[int]) -> torch.Tensor:
        """Logits ``[K+1, V]`` after ``context`` and after each token of ``chain`` (one pass of K+1 rows); the
        rows stay as the pending chain, so the part that verification accepts is kept, not re-run."""
        self.sync(context[:-1], spare=len(chain) + 1)
        n, fed = self.length, [context[-1], *chain]
        z = self.rows(fed, [n + i for i in range(len(fed))], [n + i for i in range(len(fed))],
                      [list(range(n, n + i + 1)) for i in range(len(fed))])  # [K+1, V]
        self._pending = fed
        return z

    def branches(self, starts: list[tuple[int, int]], depth: int, sampling: Sampling,
                 reshape: Reshape | None = None, stop: Callable[[], bool] | None = None) -> list[OutcomeChain] | None:
        """After ``glue``: for each ``(j, t)`` a chain of ``depth`` tokens after the glued context, its first
        j chain tokens and ``t``; one pass of ``len(starts)`` rows per step, each row seeing its own branch.
        ``stop()`` after every step: True abandons them (None)."""
        n, glued, B = self.length, len(self._pending), len(starts)
        if not starts or depth == 0:
            return [OutcomeChain([], None) for _ in starts]
        if max(j for j, _ in starts) >= glued:
            raise ValueError(f"a branch starts after position {max(j for j, _ in starts)}, the glued chain has "
                             f"{glued - 1} tokens")
        self._ensure(n + glued + B * depth)  # before any branch row exists: growing keeps only glued rows
        sees = [list(range(n, n + j + 1)) for j, _ in starts]
        positions = [n + j + 1 for j, _ in starts]
        free = n + glued

        def step(tokens: list[int]) -> torch.Tensor:
            nonlocal sees, positions, free
            slots = list(range(free, free + B))
            free += B
            sees = [seen + [slot] for seen, slot in zip(sees, slots)]
            z = self.rows(tokens, slots, positions, sees)  # [B, V]
            positions = [p + 1 for p in positions]
            return z

        return draw_branches(step, [t for _, t in starts], depth, sampling, reshape, stop)

    def verified(self, state) -> None:
        return None  # the tokens are all a draft model reads: ``sync`` follows them

    def absorb(self, verified) -> None:
        pass

    def portable(self):
        """A picklable factory of an independent copy: the weights cloned (shared ones once), the config and
        the tokenizer; the copy builds its own cache."""
        model = self.model.model
        clones: dict[int, torch.Tensor] = {}
        state = {k: clones.setdefault(v.data_ptr(), v.detach().clone()) for k, v in model.state_dict().items()}
        return partial(_rebuild, model.config.to_dict(), state, self.model.tokenizer, self._initial)

    def tree(self, context: list[int], *, depth: int, branching: int, nodes: int) -> DraftTree:
        """An EAGLE-2 dynamic top-k tree grown with the draft model (deterministic candidates)."""
        self.sync(context[:-1], spare=1 + branching * branching * depth + branching)
        n = self.length
        self._pending = []

        def expand(f: FrontierBatch) -> torch.Tensor:
            ids = f.node_ids.tolist()
            sees = [(n + f.ancestor_mask[r].nonzero().flatten()).tolist() for r in range(len(ids))]
            z = self.rows(f.tokens.tolist(), [n + i for i in ids], [n + f.depth] * len(ids), sees)  # [F, V]
            return torch.log_softmax(z, dim=-1)

        return build_dynamic_tree(context[-1], expand, branching=branching, depth=depth, nodes=nodes)


def _rebuild(config: dict, state: dict, tokenizer, initial_length: int) -> DraftLM:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=next(iter(state.values())).dtype)
    model.load_state_dict(state)
    model.tie_weights()  # a tied LM head arrives as the embedding's tensor: keep them one
    return DraftLM(HFTarget(model, tokenizer, name="draft copy", row_kernels="gemm"), initial_length=initial_length)
