"""Attention of ``HFTarget``'s explicit forward: grouped-query kernels for short passes, the masks a pass
builds (causal, per-layer committed lengths, pinned rows, sparse read views) and the attention mass a
sparse-KV drafter ranks cache slots by.

Everything here works on one layer's q/k/v and the ``PassRows`` every layer of a pass shares; the decoder
layer itself (norms, projections, MLP) and the choice between these kernels and fused SDPA live in
``targets/hf.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.targets.cache import KVCache, PinnedKV, SparseView


def grouped_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention probabilities of a few query rows, heads grouped onto their shared KV head.

    q [B, H, T, hd], k [B, Hkv, S, hd], mask bool [B|1, 1|Hkv, T, S] or None -> probs [B, Hkv, G, T, S]
    (G = H // Hkv; query head h = kv * G + g). A per-KV-head mask is what a sparse read view needs.
    """
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, hd)  # heads h = kv * G + g share KV head kv
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).view(B, Hkv, G, T, S)  # [B, Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # mask [B|1, 1|Hkv, 1, T, S]
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a few query rows against a long cache: q [B, H, T, hd], k/v [B, Hkv, S, hd] -> [B, H, T, hd].

    On CPU, PyTorch's fused SDPA kernel costs milliseconds per call for T=1 (it is built for long
    queries); two small matmuls cost microseconds. Used for decode steps and verify passes. ``probs``:
    ``grouped_probs`` already computed by the caller (who also reads them).
    """
    B, H, T, hd = q.shape
    Hkv, S = v.shape[1], v.shape[2]
    if probs is None:
        probs = grouped_probs(q, k, mask, scale)
    return torch.matmul(probs.view(B, Hkv, (H // Hkv) * T, S), v).view(B, H, T, hd)


def attention_mass(probs: torch.Tensor, rows: int) -> torch.Tensor:
    """Mass the last ``rows`` query rows put on each key, summed over those rows and each KV head's query
    heads: probs [B, Hkv, G, T, S] -> [B, Hkv, S] (float32). What a sparse-KV drafter ranks slots by."""
    return probs[:, :, :, -rows:].sum(dim=(2, 3), dtype=torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class PassRows:
    """What every layer of one pass shares: the rows' rotary tables, cache slots and attention mask."""

    cos: torch.Tensor  # [B, 1, T, hd]
    sin: torch.Tensor  # [B, 1, T, hd]
    past: int  # first slot of the rows when they are contiguous (``slots is None``)
    slots: torch.Tensor | None  # [T] explicit cache slots of the rows
    S: int  # the rows attend to cache slots [0, S)
    mask: torch.Tensor | None  # bool [B|1, 1, T, S]; None: all of [0, S) (a single decode row)
    write: bool  # write K/V into the cache (forward) or only read it (forward_with_grad)
    # Default mask on a cache whose layers have different lengths: one mask per committed length.
    layer_masks: dict[int, torch.Tensor] | None = None
    pinned: PinnedKV | None = None  # rows outside the cache that every layer may also read
    pinned_mask: torch.Tensor | None = None  # bool [B|1, 1, T, P]
    mass_rows: int = 0  # > 0: collect each layer's attention mass of the last ``mass_rows`` rows
    masses: list[torch.Tensor] | None = None  # per layer [B, Hkv, S], filled by the decoder layers (``hf._decoder_layer``)

    def row_slots(self, device: torch.device) -> torch.Tensor:
        T = self.cos.shape[2]
        return self.slots if self.slots is not None else torch.arange(self.past, self.past + T, device=device)


def default_mask(T: int, S: int, committed: int, slots: torch.Tensor) -> torch.Tensor:
    """Causal over committed + own rows: row t sees slots [0, committed) and the rows 0..t at ``slots [T]``."""
    m = torch.zeros(T, S, dtype=torch.bool, device=slots.device)  # [T, S]
    m[:, :committed] = True
    # Own slots below ``committed`` are rows of this pass, not context: causal among the rows only.
    m[:, slots] = torch.ones(T, T, dtype=torch.bool, device=slots.device).tril()
    return m.view(1, 1, T, S)


def layer_mask(r: PassRows, cache: KVCache, li: int) -> torch.Tensor:
    # Rows a layer holds beyond ``S`` (later provisional rows) are never visible to this pass.
    c = min(cache.layer_length(li), r.S)
    m = r.layer_masks.get(c)
    if m is None:
        m = r.layer_masks[c] = default_mask(r.cos.shape[2], r.S, c, r.row_slots(r.cos.device))
    return m


def layer_mass(r: PassRows, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, probs: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """``attention_mass`` of the last ``r.mass_rows`` rows over cache slots [0, S) -> [B, Hkv, S].

    ``probs`` of a grouped pass are reused; after fused SDPA (a long prefill) only the W rows are scored
    again, a W x S product per head. Pinned rows sit in front of the keys and are left out.
    """
    W = min(r.mass_rows, q.shape[2])
    if probs is None:
        rows_mask = None if mask is None else mask[..., -W:, :]  # [B|1, 1|Hkv, W, S']
        probs = grouped_probs(q[:, :, -W:], k, rows_mask, scale)  # [B, Hkv, G, W, S']
    mass = attention_mass(probs, W)  # [B, Hkv, S']
    return mass[..., mass.shape[-1] - r.S:]  # drop pinned columns: [B, Hkv, S]


def with_pinned(r: PassRows, li: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Pinned rows' keys/values in front of the pass's own keys ``k/v [B, Hkv, S, hd]``, the mask widened."""
    B, _, S, _ = k.shape
    pk = r.pinned.k[li].to(k.dtype).expand(B, -1, -1, -1)  # [B, Hkv, P, hd]
    pv = r.pinned.v[li].to(v.dtype).expand(B, -1, -1, -1)
    T, P = r.cos.shape[2], pk.shape[2]
    if mask is None:
        mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=k.device)
    bm, hm = max(mask.shape[0], r.pinned_mask.shape[0]), mask.shape[1]
    mask = torch.cat([r.pinned_mask.expand(bm, hm, T, P), mask.expand(bm, hm, T, S)], dim=-1)
    return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), mask


def sparse_keys(cache: KVCache, li: int, r: PassRows, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 idx: torch.Tensor):
    """Keys/values of a sparse read: the view's slots of each KV head, then the rows' own K/V.

    k/v [B, Hkv, T, hd] (the rows, after RoPE); idx [Hkv, K]. The rows' own slots are read from ``k/v``
    rather than the cache, so the same code serves the read-only (grad) pass.
    """
    T = k.shape[2]
    own_slots = r.row_slots(k.device)  # [T]
    if r.write:
        if r.slots is None:
            cache.write(li, r.past, k, v)
        else:
            cache.write_at(li, r.slots, k, v)
        readable = r.S
    else:
        readable = r.past  # the grad pass sees only committed slots
    if idx.numel() and int(idx.max()) >= readable:
        raise ValueError(f"sparse view of layer {li} reads slot {int(idx.max())}, beyond the {readable} readable")
    idx = idx.to(k.device)
    ks = SparseView.gather(idx, cache.k[li, :, :, :readable])  # [B, Hkv, K, hd]
    vs = SparseView.gather(idx, cache.v[li, :, :, :readable])  # [B, Hkv, K, hd]
    if mask is None:
        mask = torch.ones(1, 1, T, r.S, dtype=torch.bool, device=k.device)  # [1, 1, T, S]
    own = torch.zeros(r.S, dtype=torch.bool, device=k.device)  # [S]
    own[own_slots] = True
    m_view = SparseView.gather_mask(idx, mask, own)  # [B|1, Hkv, T, K]
    m_rows = mask[..., own_slots].expand(-1, idx.shape[0], -1, -1)  # [B|1, Hkv, T, T]
    return (torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2),  # [B, Hkv, K + T, hd]
            torch.cat([m_view, m_rows], dim=-1))  # [B|1, Hkv, T, K + T]


def layer_keys(cache: KVCache | None, li: int, r: PassRows, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None, idx: torch.Tensor | None):
    """The keys/values layer ``li`` of a pass attends to, and its mask: the rows' own ``k/v [B, Hkv, T, hd]``
    joined with what the cache holds (written to it when the pass writes), a sparse view's slots, pinned rows.

    Returns k/v [B, Hkv, S', hd] and mask [B|1, 1|Hkv, T, S'] or None (S' = S, K + T with a view, plus P)."""
    if idx is not None:
        k, v, mask = sparse_keys(cache, li, r, k, v, mask, idx)  # [B, Hkv, K + T, hd], mask [B|1, Hkv, T, K + T]
    elif cache is not None and r.write:
        if r.slots is None:
            k, v = cache.write(li, r.past, k, v)  # [B, Hkv, S, hd]
        else:
            cache.write_at(li, r.slots, k, v)
            k, v = cache.k[li, :, :, :r.S], cache.v[li, :, :, :r.S]  # [B, Hkv, S, hd]
    elif cache is not None:
        # Read-only (grad) pass: concatenated, not written, so autograd keeps every layer's own keys.
        k = torch.cat([cache.k[li, :, :, :r.past], k], dim=2)  # [B, Hkv, S, hd]
        v = torch.cat([cache.v[li, :, :, :r.past], v], dim=2)  # [B, Hkv, S, hd]
    if r.pinned is not None:
        k, v, mask = with_pinned(r, li, k, v, mask)  # [B, Hkv, P + S', hd], mask [B|1, 1|Hkv, T, P + S']
    return k, v, mask


def pass_mask(attn_mask: torch.Tensor | None, T: int, S: int, past: int, *, explicit_slots: bool, per_layer: bool,
              device: torch.device):
    """(mask [B|1, 1, T, S] or None, per-layer mask memo or None) of a pass of T rows over slots [0, S).

    ``per_layer``: the default mask depends on each layer's committed length (explicit slots, or a ragged
    cache being written), so it is built per layer on first use (``layer_mask``)."""
    if attn_mask is not None:
        if attn_mask.shape[-2:] != (T, S):
            what = "new rows x (max slot + 1)" if explicit_slots else "new rows x (past + new)"
            raise ValueError(f"attn_mask must be [.., {T}, {S}] ({what}), got {tuple(attn_mask.shape)}")
        return attn_mask.view(-1, 1, T, S), None
    if per_layer:
        return None, {}
    # Plain causal over the new rows; a single row needs no mask at all.
    return (None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=device).tril(past).view(1, 1, T, S)), None


def pinned_rows_mask(pinned: PinnedKV | None, pinned_mask: torch.Tensor | None, num_layers: int, B: int, T: int,
                     device: torch.device) -> torch.Tensor | None:
    """bool [B|1, 1, T, P]: which of the T rows read which pinned row (default: all), checked against
    a ``num_layers``-layer target and batch ``B``; None without pinned rows."""
    if pinned is None:
        if pinned_mask is not None:
            raise ValueError("pinned_mask without pinned keys")
        return None
    P = pinned.num_rows
    if pinned.k.shape[0] != num_layers or pinned.k.shape[1] not in (1, B):
        raise ValueError(f"pinned keys {tuple(pinned.k.shape)} do not fit a {num_layers}-layer "
                         f"target and batch {B} ([L, 1|B, Hkv, P, hd])")
    if pinned_mask is None:
        return torch.ones(1, 1, T, P, dtype=torch.bool, device=device)
    if pinned_mask.shape[-2:] != (T, P):
        raise ValueError(f"pinned_mask must be [.., {T}, {P}] (new rows x pinned rows), got "
                         f"{tuple(pinned_mask.shape)}")
    return pinned_mask.to(device=device, dtype=torch.bool).view(-1, 1, T, P)
