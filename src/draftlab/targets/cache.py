"""Pre-allocated KV cache for the target, with a scratch area for verify passes, per-layer lengths and sparse views.

Layout: ``k, v`` are ``[L, B, H_kv, S_max, hd]``, allocated once. Slots ``[0, length)`` hold the committed
context. A forward pass writes its T new rows to the scratch slots ``[length, length + T)`` and attends to
``[0, length + T)`` under an explicit mask; nothing becomes part of the context until ``commit``:

- ``commit(n)`` keeps the first n scratch rows (prefill, AR steps, chains accepted from the start);
- ``commit_rows(rows)`` keeps the given scratch rows in order, copying them into contiguous slots (the
  accepted root-to-leaf path of a tree; every other tree node and any extra rows — ConFu's contemplate
  tokens — are simply left behind in scratch and overwritten by the next pass).

No step reallocates the cache: a verify pass costs one in-place write per layer, a commit one gather.

Self-speculative drafters run only some of the target's layers (``Target.forward_layers``), so a token can be
computed to different depths. Each layer therefore has its own length, ``layer_length(l) >= length``: rows
``[length, layer_length(l))`` of layer l are *provisional* rows kept with ``commit_layers`` (a drafter's
earlier steps, written with ``write_at`` at explicit slots) and dropped with ``truncate(n, layers=...)``.
``length`` stays the committed length common to all layers (the minimum). ``commit``/``commit_rows`` follow
a pass over every layer, which overwrote the scratch slots at every layer, so they reset all layers to the
new common length.

``SparseView`` restricts what a pass reads: per layer, per KV head, the slots ``[Hkv, K]`` attention may see
(besides the new rows themselves), for sparse-KV drafting. Read in place (``forward_layers(view=)``) every
pass gathers the slots again; ``SparseView.compact`` gathers them once into a small cache of their own, over
which several draft steps then run as plain dense forwards (keys keep their RoPE positions, so attention
over a compacted view equals attention over the same slots in place).

``PinnedKV`` holds keys/values of rows that belong to no sequence and never change (ConFu's soft prompts):
computed once, then read by any pass that is given them, next to its cache, without occupying cache slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_length: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, hd]
        self.max_length = max_length
        self.num_layers = num_layers
        self._lengths = [0] * num_layers  # per layer: slots [0, n) hold valid rows of that layer
        self._length = 0  # == min(self._lengths), cached: read on every forward
        self._ragged = False  # some layer has provisional rows beyond ``length``

    # ---- lengths ------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Committed length common to all layers."""
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        # Assigning the length (e.g. after copying rows into a grown cache) means every layer has n rows.
        self._set_all(int(n))

    def layer_length(self, layer: int) -> int:
        """Rows of layer ``layer`` that are valid: ``length`` plus its provisional rows."""
        return self._lengths[layer]

    @property
    def ragged(self) -> bool:
        """True when some layer has provisional rows beyond ``length`` (a per-layer default mask is needed)."""
        return self._ragged

    def _set_all(self, n: int) -> None:
        self._lengths = [n] * self.num_layers
        self._length, self._ragged = n, False

    def _sync(self) -> None:
        self._length = min(self._lengths) if self._lengths else 0
        self._ragged = any(n != self._length for n in self._lengths)

    def _layer_ids(self, layers: Iterable[int] | None) -> list[int]:
        ids = list(range(self.num_layers)) if layers is None else [int(i) for i in layers]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range for a {self.num_layers}-layer cache")
        return ids

    # ---- writing --------------------------------------------------------------------------------------

    def reserve(self, num_rows: int) -> int:
        """Check that ``num_rows`` scratch rows fit and return the first scratch slot."""
        if self.length + num_rows > self.max_length:
            raise RuntimeError(
                f"KV cache overflow: {self.length} committed + {num_rows} new rows > max_length {self.max_length}; "
                "allocate a larger cache (prompt + max_new_tokens + tree size)"
            )
        return self.length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new rows ``k, v [B, H, T, hd]`` at ``start`` and return this layer's keys/values up to them."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, H, end, hd]

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows ``k, v [B, H, T, hd]`` at the explicit (distinct) slots ``slots [T]``.

        Lengths do not change: a row written past ``layer_length`` is scratch until ``commit_layers``.
        """
        self.k[layer].index_copy_(2, slots, k)  # k[layer] [B, H, S_max, hd]
        self.v[layer].index_copy_(2, slots, v)

    def check_slots(self, slots: torch.Tensor) -> None:
        """``ValueError``/``RuntimeError`` unless ``slots [T]`` are distinct slots inside the cache."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.max_length):
            raise RuntimeError(f"KV cache overflow: slots {slots.tolist()} outside [0, {self.max_length})")
        if slots.unique().numel() != slots.numel():
            raise ValueError(f"cache slots must be distinct, got {slots.tolist()}")

    # ---- committing and rolling back -----------------------------------------------------------------

    def commit(self, n: int) -> None:
        """The first ``n`` scratch rows become context at every layer (they are already in place)."""
        self.reserve(n)
        self._set_all(self._length + n)

    def commit_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep scratch rows ``rows`` (offsets from the scratch start, ascending) as the next context slots."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        n = rows.numel()
        if n == 0:
            # Nothing kept, but the pass before overwrote every layer's scratch: provisional rows are gone.
            self._set_all(self._length)
            return
        # A prefix 0..n-1 is already contiguous: skip the copy (the common case for chains).
        if not torch.equal(rows, torch.arange(n, device=rows.device)):
            src = self.length + rows
            dst = slice(self.length, self.length + n)
            # index_select materialises the gathered rows first, so overlapping src/dst ranges are safe.
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self._set_all(self._length + n)

    def commit_layers(self, n: int, layers: Iterable[int] | None = None) -> None:
        """Rows ``[layer_length(l), layer_length(l) + n)`` of each layer in ``layers`` become valid there.

        For tokens computed to different depths: a self-drafter that ran layers ``[0, E)`` on a token at slot
        ``layer_length(0)`` keeps it with ``commit_layers(1, range(E))``; ``length`` grows only once every
        layer has the row.
        """
        for layer in self._layer_ids(layers):
            if self._lengths[layer] + n > self.max_length:
                raise RuntimeError(f"KV cache overflow: layer {layer} has {self._lengths[layer]} rows, "
                                   f"+ {n} > max_length {self.max_length}")
            self._lengths[layer] += n
        self._sync()

    def truncate(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Forget rows beyond ``length`` (roll back provisional rows, or context in tests).

        Without ``layers``: every layer, and ``length <= self.length``. With ``layers``: only those layers,
        each of which must hold at least ``length`` rows; ``length`` becomes the new minimum.
        """
        if layers is None:
            if not 0 <= length <= self.length:
                raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
            self._set_all(length)
            return
        for layer in self._layer_ids(layers):
            if not 0 <= length <= self._lengths[layer]:
                raise ValueError(f"cannot truncate layer {layer} of length {self._lengths[layer]} to {length}")
            self._lengths[layer] = length
        self._sync()

    def reset(self) -> None:
        self._set_all(0)


@dataclass
class SparseView:
    """A sparse read view: per layer, the cache slots each KV head may read, ``indices[l] [Hkv, K]`` (long).

    A pass given a view attends, at each layer present in ``indices``, to the listed slots of each KV head plus
    the pass's own rows; layers absent from ``indices`` read densely. The pass's attention mask still applies
    at the listed slots, so a view never lets a row see more than it would densely. K may differ between
    layers but is the same for every head of a layer (pad by repeating a slot: a repeat is masked out).
    """

    indices: Mapping[int, torch.Tensor]

    @classmethod
    def full(cls, layers: Iterable[int], num_kv_heads: int, length: int, device: torch.device | str = "cpu"
             ) -> SparseView:
        """Every slot ``[0, length)`` for every head of ``layers`` (attention then equals dense)."""
        idx = torch.arange(length, device=device).expand(num_kv_heads, length)  # [Hkv, length]
        return cls({int(layer): idx for layer in layers})

    def layer(self, layer: int) -> torch.Tensor | None:
        """The slots of ``layer`` ``[Hkv, K]``, or None when the layer reads densely."""
        return self.indices.get(layer)

    def compact(self, cache: KVCache, scratch_rows: int, out: KVCache | None = None) -> KVCache:
        """The view's slots gathered into a dense cache of ``K`` committed rows plus ``scratch_rows`` of scratch.

        Row j of KV head h at layer l is slot ``indices[l][h, j]`` of ``cache``. Every layer needs the same K
        and distinct slots per head (a dense pass would count a repeated slot twice). ``out``, when large
        enough, is reused (a drafter compacts once per round; no allocation then).
        """
        L = cache.num_layers
        missing = [li for li in range(L) if li not in self.indices]
        if missing:
            raise ValueError(f"compact needs a view of every layer; layers {missing} have none")
        idx = torch.stack([torch.as_tensor(self.indices[li]).to(cache.k.device) for li in range(L)])  # [L, Hkv, K]
        K = idx.shape[-1]
        srt = idx.sort(dim=-1).values
        if K > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
            raise ValueError("compact needs distinct slots per head; a repeated slot would be attended twice")
        if K and (int(idx.min()) < 0 or int(idx.max()) >= cache.length):
            raise ValueError(f"view slots must lie in the committed context [0, {cache.length})")
        _, B, Hkv, _, hd = cache.k.shape
        if out is None or out.max_length < K + scratch_rows or out.k.shape[1] != B:
            out = KVCache(L, B, Hkv, hd, K + scratch_rows, dtype=cache.k.dtype, device=cache.k.device)
        index = idx[:, None, :, :, None].expand(L, B, Hkv, K, hd)  # [L, B, Hkv, K, hd]
        out.k[:, :, :, :K] = torch.gather(cache.k, 3, index)
        out.v[:, :, :, :K] = torch.gather(cache.v, 3, index)
        out.length = K
        return out

    @staticmethod
    def gather(idx: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Rows ``idx [Hkv, K]`` of each KV head of ``kv [B, Hkv, S, hd]`` -> ``[B, Hkv, K, hd]``."""
        B, Hkv, _, hd = kv.shape
        return kv.gather(2, idx[None, :, :, None].expand(B, Hkv, idx.shape[1], hd))

    @staticmethod
    def gather_mask(idx: torch.Tensor, mask: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """The attention mask at the view's slots.

        idx [Hkv, K]; mask bool [Bm, 1, T, S] over cache slots; own bool [S], True at the pass's own slots
        (read separately, so masked here: a view listing them must not count them twice) -> [Bm, Hkv, T, K].
        A slot listed twice for one head is kept once, so padding by repetition is harmless.
        """
        Hkv, K = idx.shape
        keep = ~own[idx]  # [Hkv, K]
        if K > 1:
            srt, order = idx.sort(dim=1)  # [Hkv, K]
            first = torch.ones_like(keep)
            first[:, 1:] = srt[:, 1:] != srt[:, :-1]
            keep = keep & first.scatter(1, order, first)  # back to idx order: [Hkv, K]
        m = mask[:, 0][:, :, idx]  # [Bm, T, Hkv, K]
        return m.permute(0, 2, 1, 3) & keep[None, :, None, :]  # [Bm, Hkv, T, K]


@dataclass
class PinnedKV:
    """Per-layer keys/values of ``P`` rows computed once and read by many passes (``Target.forward(pinned=)``).

    Rows whose attention never reaches the sequence (they see only each other) have the same keys and
    values in every pass, so re-running them each time is wasted work. Capture them once from a small
    cache (``capture``) and pass them to later forwards with a mask saying which new rows see which of them.
    """

    k: torch.Tensor  # [L, B, Hkv, P, hd] (B = 1 broadcasts over any batch)
    v: torch.Tensor  # [L, B, Hkv, P, hd]

    @classmethod
    def capture(cls, cache: KVCache) -> PinnedKV:
        """The committed rows ``[0, cache.length)`` of every layer of ``cache`` (copied)."""
        n = cache.length
        return cls(cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone())

    @property
    def num_rows(self) -> int:
        return int(self.k.shape[3])
