"""The ConFu draft: an EAGLE-3 draft that also reads one future token per drafting round.

ConFu ("Contemplate the Future", arXiv 2603.08899) adds to EAGLE-3

- target side: ``s`` learnable soft prompts and a dynamic contemplate token ``[con]`` whose embedding
  comes from an MoE over learnable expert embeddings, keyed on the target features of the last accepted
  token (``con_moe``). Only contemplate rows see the soft prompts, and nothing sees a contemplate row,
  so the target's normal rows are untouched;
- draft side: the future vector ``f = fc(h_con)`` (the contemplate row's three tapped target states
  through the draft's fc, or a separate ``fc_f``) and the future-token embedding ``e_f`` from a second
  MoE (``f_moe``). The pair enters the draft like any row, ``concat(norm(e_f), norm(f))``, as ONE extra
  key/value that the draft rows of its window attend to (``model.Eagle3DecoderLayer`` unchanged).

The future row attends only to itself, so its keys/values are a function of ``(e_f, f, position)`` alone
and are computed once per anchor (``future_kv``). It sits at the anchor's own position: draft row ``a``
(which consumes ``x_{a+1}`` with the target features of ``x_a``) is the first row to see it.

Which rows see which future (``future_visibility``): row ``t`` sees the future of the latest anchor
``a <= t`` while ``t - a < config.future_window``, and no other; the trainer and the drafter apply the
same rule. A future never reaches a row before its anchor, so it cannot leak later tokens.

The ``[f]`` MoE is keyed on the draft's fused feature ``fc(F_a)`` of the anchor row (its hidden input),
not on the decoder output of a row: every decoder output at or after an anchor attends to that anchor's
future, so keying on one would chain each anchor's future on the previous one (sequential training) or
on itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.methods.confu.config import ConFuConfig
from draftlab.methods.eagle3.model import Eagle3Draft, causal_mask, masked_attention
from draftlab.methods.eagle3.ttt import TTTAttention, ttt_attention_mask

# ------------------------------------------------------------------------------------------------------
# dynamic token embeddings


class EmbeddingMoE(nn.Module):
    """A token embedding chosen per input: linear router over ``n_experts`` learnable embeddings, top-k.

    ``gate = softmax(router(rmsnorm(x)))``; the top ``top_k`` gates are kept and renormalised, and the output
    is their weighted sum of expert embeddings. ``enabled=False`` is a single learned embedding (no router).
    With ``top_k == 1`` the kept gate is always 1, so the router receives no gradient.
    """

    def __init__(self, in_features: int, out_features: int, n_experts: int, top_k: int, *, enabled: bool = True):
        super().__init__()
        self.in_features = in_features
        self.top_k = min(top_k, n_experts) if enabled else 1
        self.experts = nn.Parameter(torch.zeros(n_experts if enabled else 1, out_features))  # [n, out]
        self.router = nn.Linear(in_features, n_experts, bias=False) if enabled else None

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [..., k], expert ids [..., k])`` for inputs ``x [..., in]``."""
        if self.router is None:
            shape = (*x.shape[:-1], 1)
            return (torch.ones(shape, dtype=self.experts.dtype, device=x.device),
                    torch.zeros(shape, dtype=torch.long, device=x.device))
        # Target hidden states grow large with depth; normalising the router input keeps the gate
        # temperature independent of which layers are tapped.
        u = F.rms_norm(x.to(self.router.weight.dtype), (self.in_features,))
        probs = torch.softmax(self.router(u).float(), dim=-1)  # [..., n]
        top, ids = probs.topk(self.top_k, dim=-1)  # [..., k]
        return (top / top.sum(-1, keepdim=True)).to(self.experts.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = self.gates(x)  # [..., k]
        return (w.unsqueeze(-1) * self.experts[ids]).sum(-2)  # [..., out]

    @torch.no_grad()
    def reset_parameters(self, center: torch.Tensor, spread: torch.Tensor, generator: torch.Generator | None = None
                         ) -> None:
        """Experts at ``center + 0.1 * spread * noise`` (near the mean token embedding); a small router."""
        # Drawn on the generator's device (the CPU by default): a seed gives the same experts on any device.
        noise = torch.randn(self.experts.shape, generator=generator).to(self.experts)
        self.experts.copy_(center.to(self.experts) + 0.1 * spread.to(self.experts) * noise)
        if self.router is not None:
            w = torch.randn(self.router.weight.shape, generator=generator) * (0.1 / self.in_features ** 0.5)
            self.router.weight.copy_(w.to(self.router.weight))


# ------------------------------------------------------------------------------------------------------
# attention with future keys


class FutureCapture:
    """``DraftAttention`` for future rows: each row attends only to itself; records every layer's k/v."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.kv.append((k, v))
        # Softmax over a single key is 1: the output is the row's own value, shared by its head group.
        return v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, H, T, hd]


def future_visibility(anchors: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """bool ``[B, T, K]``: draft row t sees anchor j's future token.

    anchors [B, K] ascending target positions, -1 for unused slots. Row t sees the latest anchor ``a <= t``
    iff ``t - a < window`` (and nothing else), so no row sees a future anchored after it.
    """
    t = torch.arange(length, device=anchors.device)  # [T]
    a = anchors[:, None, :]  # [B, 1, K]
    before = (a >= 0) & (a <= t[None, :, None])  # [B, T, K]
    latest = torch.where(before, a, torch.full_like(a, -1)).amax(-1)  # [B, T]
    in_window = (latest >= 0) & (t[None] - latest < window)  # [B, T]
    return before & (a == latest[..., None]) & in_window[..., None]


def future_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         attention_mask: torch.Tensor | None, future_k: torch.Tensor, future_v: torch.Tensor,
                         future_mask: torch.Tensor, scale: float, query_rows: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """TTT step ``len(keys) - 1`` (see ``eagle3.ttt.ttt_attention``) plus a block of future keys.

    q [B, H, T, hd]; keys/values per step, each [B, Hkv, T, hd]; future_k/v [B, Hkv, K, hd];
    future_mask bool [B, T, K] -> [B, H, T, hd]. Scores: causal over step-0 keys, the future keys the row
    may see, and the row's own keys of steps 1..k (elementwise), under one softmax.
    ``query_rows`` [M]: only these rows are unrolled (q and the keys of steps 1..k hold M rows), as in
    ``ttt_attention``; each sees the step-0 keys up to its own row and its own row of ``future_mask``.
    """
    B, H, M, hd = q.shape
    T, Hkv, K = keys[0].shape[2], keys[0].shape[1], future_k.shape[2]
    G = H // Hkv
    qf = q.reshape(B, Hkv, G * M, hd)  # heads h = kv * G + g share KV head kv
    qg = q.reshape(B, Hkv, G, M, hd)
    ct = torch.promote_types(q.dtype, torch.float32)
    low = torch.finfo(ct).min
    mask = causal_mask(T, attention_mask, device=q.device)  # [B|1, T, T]
    if query_rows is not None:
        rows = query_rows.to(q.device)
        mask, future_mask = mask[:, rows], future_mask[:, rows]  # [B|1, M, T], [B, M, K]
    prefix = torch.matmul(qf, keys[0].transpose(-1, -2)).view(B, Hkv, G, M, T).to(ct) * scale  # [B, Hkv, G, M, T]
    prefix = prefix.masked_fill(~mask[:, None, None], low)
    fut = torch.matmul(qf, future_k.transpose(-1, -2)).view(B, Hkv, G, M, K).to(ct) * scale  # [B, Hkv, G, M, K]
    fut = fut.masked_fill(~future_mask[:, None, None], low)
    parts = [prefix, fut]
    if len(keys) > 1:
        parts.append(torch.stack([(qg * k_i[:, :, None]).sum(-1) for k_i in keys[1:]], -1).to(ct) * scale)
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(values[0].dtype)  # [B, Hkv, G, M, T + K + k]
    out = torch.matmul(probs[..., :T].reshape(B, Hkv, G * M, T), values[0]).view(B, Hkv, G, M, hd)
    out = out + torch.matmul(probs[..., T:T + K].reshape(B, Hkv, G * M, K), future_v).view(B, Hkv, G, M, hd)
    for i, v_i in enumerate(values[1:]):
        out = out + probs[..., T + K + i, None] * v_i[:, :, None]  # [B, Hkv, G, M, hd]
    return out.reshape(B, H, M, hd)


def naive_future_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                               attention_mask: torch.Tensor | None, future_k: torch.Tensor,
                               future_v: torch.Tensor, future_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Brute-force reference for ``future_ttt_attention``: concatenated keys under one explicit mask."""
    T = q.shape[2]
    base = ttt_attention_mask(T, len(keys), attention_mask, device=q.device)  # [B|1, T, (k+1)T]
    base = base.expand(future_mask.shape[0], -1, -1)
    mask = torch.cat([base[..., :T], future_mask, base[..., T:]], dim=-1)  # [B, T, T + K + kT]
    k_all = torch.cat([keys[0], future_k, *keys[1:]], dim=2)  # [B, Hkv, T + K + kT, hd]
    v_all = torch.cat([values[0], future_v, *values[1:]], dim=2)  # [B, Hkv, T + K + kT, hd]
    return masked_attention(q, k_all, v_all, mask, scale)


class FutureTTTAttention(TTTAttention):
    """``TTTAttention`` whose rows also attend to per-layer future keys ``future_kv[layer] = (k, v)``.

    future_kv    one ``(k, v)`` pair per draft layer, each [B, Hkv, K, hd] (from ``ConFuDraft.future_kv``).
    future_mask  bool [B, T, K] (``future_visibility``); the same at every TTT step, as at inference,
                 where a round's tree nodes all see the round's future token.
    ``query_rows`` (set after step 0) unrolls only those rows, as ``TTTAttention``'s does.
    """

    def __init__(self, attention_mask: torch.Tensor | None, future_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 future_mask: torch.Tensor, *, impl: str = "auto"):
        # The future keys have a torch implementation only (the TTT kernels know the prefix and the diagonal).
        if impl not in ("auto", "torch", "naive"):
            raise ValueError(f"ConFu's TTT attention (with future keys) runs on torch or naive, got '{impl}'")
        super().__init__(attention_mask, impl="naive" if impl == "naive" else "torch")
        self.future_kv = future_kv
        self.future_mask = future_mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        keys, values = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        keys.append(k)
        values.append(v)
        fk, fv = self.future_kv[layer]
        if self.query_rows is not None and len(keys) > 1:
            return future_ttt_attention(q, keys, values, self.attention_mask, fk, fv, self.future_mask, scale,
                                        self.query_rows)
        fn = naive_future_ttt_attention if self.naive else future_ttt_attention
        return fn(q, keys, values, self.attention_mask, fk, fv, self.future_mask, scale)


# ------------------------------------------------------------------------------------------------------
# the draft


class ConFuDraft(Eagle3Draft):
    """An ``Eagle3Draft`` plus soft prompts, the two MoEs and an optional ``fc_f`` (module docstring).

    The EAGLE-3 parameters keep their names, so ``from_eagle3`` is a plain state-dict load.
    """

    def __init__(self, config: ConFuConfig):
        super().__init__(config)
        c, d, dt = config, config.hidden_size, config.target_hidden_size
        self.soft_prompts = nn.Parameter(torch.zeros(c.num_soft_prompts, dt))  # [s, d_t]
        self.con_moe = EmbeddingMoE(3 * dt, dt, c.n_experts, c.top_k_experts, enabled=c.moe)
        self.f_moe = EmbeddingMoE(d, d, c.n_experts, c.top_k_experts, enabled=c.moe)
        self.fc_f = nn.Linear(3 * dt, d, bias=False) if c.separate_fc_f else None

    # ---- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_eagle3(cls, draft: Eagle3Draft, *, generator: torch.Generator | None = None, **confu: Any) -> ConFuDraft:
        """A ConFu draft whose EAGLE-3 part is a copy of ``draft``; ``confu`` sets ``ConFuConfig`` fields.

        The new parts start as ``init_confu_parameters`` leaves them (``fc_f``, if any, from ``fc``).
        """
        config = ConFuConfig.from_eagle3(draft.config, **confu)
        w = draft.fc.weight
        new = cls(config).to(device=w.device, dtype=w.dtype)
        missing, unexpected = new.load_state_dict(draft.state_dict(), strict=False)
        own = tuple(new.confu_state_prefixes())
        if unexpected or any(not k.startswith(own) for k in missing):
            raise ValueError(f"not an EAGLE-3 draft state: missing {missing}, unexpected {unexpected}")
        new.init_confu_parameters(generator)
        return new

    @classmethod
    def from_target(cls, target, *, vocab_mapping=None, draft_vocab_size: int | None = None,
                    generator: torch.Generator | None = None, **config_kwargs: Any) -> ConFuDraft:
        """A fresh ConFu draft sized like ``target`` (``Eagle3Draft.from_target`` plus ConFu fields)."""
        names = ConFuConfig.confu_field_names()
        confu = {k: config_kwargs.pop(k) for k in list(config_kwargs) if k in names}
        base = Eagle3Draft.from_target(target, vocab_mapping=vocab_mapping, draft_vocab_size=draft_vocab_size,
                                       **config_kwargs)
        return cls.from_eagle3(base, generator=generator, **confu)

    @classmethod
    def from_eagle3_export(cls, path: str | Path, *, target=None, generator: torch.Generator | None = None,
                           **confu: Any) -> ConFuDraft:
        """Initialise from an EAGLE-3 export or checkpoint (anything ``methods.eagle3.export.load_draft`` reads)."""
        from draftlab.methods.eagle3.export.convert import load_draft

        return cls.from_eagle3(load_draft(path, target=target), generator=generator, **confu)

    @staticmethod
    def confu_state_prefixes() -> list[str]:
        """State-dict name prefixes of the parts ConFu adds to an EAGLE-3 draft."""
        return ["soft_prompts", "con_moe.", "f_moe.", "fc_f."]

    def confu_parameters(self) -> list[nn.Parameter]:
        """The parameters ConFu adds (soft prompts, both MoEs, ``fc_f``)."""
        own = tuple(self.confu_state_prefixes())
        return [p for n, p in self.named_parameters() if n.startswith(own)]

    @torch.no_grad()
    def init_confu_parameters(self, generator: torch.Generator | None = None) -> None:
        """Soft prompts = embeddings of random vocabulary tokens (prompt-tuning init); MoE experts near the
        mean token embedding; small routers; ``fc_f`` a copy of ``fc``. Needs the target embedding loaded."""
        emb = self.embed_tokens.weight.float()  # [V, d]
        if not emb.is_meta and not torch.isfinite(emb).all():  # (a meta draft has no values to check)
            raise ValueError("the draft has no target embedding (NaN): load it before initialising ConFu")
        # Random draws on the generator's device (the CPU by default), so a seed gives the same draft on any
        # device; the statistics stay where the embedding is.
        ids = torch.randint(emb.shape[0], (self.soft_prompts.shape[0],), generator=generator)
        self.soft_prompts.copy_(emb[ids.to(emb.device)].to(self.soft_prompts))
        center, spread = emb.mean(0), emb.std(0)  # [d]
        self.con_moe.reset_parameters(center, spread, generator)
        self.f_moe.reset_parameters(center, spread, generator)
        if self.fc_f is not None:
            self.fc_f.weight.copy_(self.fc.weight)

    # ---- ConFu pieces ----------------------------------------------------------------------------------

    def contemplate_embedding(self, key_aux: torch.Tensor) -> torch.Tensor:
        """``[con]`` input embeddings ``[..., d_t]`` from the target features ``[..., 3*d_t]`` of the last
        accepted token (the MoE key)."""
        return self.con_moe(key_aux)

    def future_vector(self, con_aux: torch.Tensor) -> torch.Tensor:
        """``f [..., d]`` from a contemplate row's tapped target states ``[..., 3*d_t]``."""
        if self.fc_f is None:
            return self.project(con_aux)
        x = con_aux.to(self.fc_f.weight.dtype)
        if self.config.fc_norm:
            x = torch.cat([norm(h) for norm, h in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        elif self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc_f(x)

    def future_embedding(self, anchor_aux: torch.Tensor) -> torch.Tensor:
        """``e_f [..., d]`` from the anchor row's target features ``[..., 3*d_t]`` (keyed on ``fc`` of them)."""
        return self.f_moe(self.project(anchor_aux))

    def forward_embeds(self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       attention) -> torch.Tensor:
        """The draft layers over rows given by an input embedding ``emb [B, T, d]`` and a d-dim ``hidden``;
        returns the pre-norm output states ``[B, T, d]``."""
        hidden = hidden.to(self.fc.weight.dtype)
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, 1, T, hd]
        h = self.midlayer(emb.to(hidden.dtype), hidden, cos, sin, attention, 0)  # [B, T, d]
        for i, layer in enumerate(self.additional_layers, start=1):
            h = layer(None, h, cos, sin, attention, i)
        return h

    def future_kv(self, e_f: torch.Tensor, f: torch.Tensor, positions: torch.Tensor
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer ``(k, v) [B, Hkv, K, hd]`` of future rows ``(e_f, f) [B, K, d]`` at ``positions [B, K]``.

        A future row attends only to itself, so these do not depend on any other row.
        """
        capture = FutureCapture()
        self.forward_embeds(e_f, f, positions, capture)
        return capture.kv


def build_confu_draft(target, *, vocab_mapping=None, draft_vocab_size: int | None = None,
                      init_from: str | Path | None = None, generator: torch.Generator | None = None,
                      **fields: Any) -> ConFuDraft:
    """A ConFu draft from the ``method.draft`` block of ``conf/method/confu.yaml``.

    ``init_from`` None: a fresh draft sized like ``target`` (``fields`` = Eagle3Config overrides plus
    ConFu fields). Otherwise the EAGLE-3 part, vocabulary mapping included, comes from that export or
    checkpoint; an Eagle3Config field given in ``fields`` must then agree with it.
    """
    if init_from is None:
        return ConFuDraft.from_target(target, vocab_mapping=vocab_mapping, draft_vocab_size=draft_vocab_size,
                                      generator=generator, **fields)
    names = ConFuConfig.confu_field_names()
    confu = {k: v for k, v in fields.items() if k in names}
    base = fields.keys() - names
    draft = ConFuDraft.from_eagle3_export(init_from, target=target, generator=generator, **confu)
    clash = {k: (fields[k], getattr(draft.config, k)) for k in base if getattr(draft.config, k) != fields[k]}
    if clash:
        raise ValueError(f"init_from={init_from} disagrees with the configured draft fields "
                         f"(configured, exported): {clash}")
    return draft
