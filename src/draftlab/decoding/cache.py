"""Pre-allocated KV cache for the target, with a scratch area for verify passes.

Layout: ``k, v`` are ``[L, B, H_kv, S_max, hd]``, allocated once. Slots ``[0, length)`` hold the committed
context. A forward pass writes its T new rows to the scratch slots ``[length, length + T)`` and attends to
``[0, length + T)`` under an explicit mask; nothing becomes part of the context until ``commit``:

- ``commit(n)`` keeps the first n scratch rows (prefill, AR steps, chains accepted from the start);
- ``commit_rows(rows)`` keeps the given scratch rows in order, copying them into contiguous slots (the
  accepted root-to-leaf path of a tree; every other tree node and any extra rows — ConFu's contemplate
  tokens — are simply left behind in scratch and overwritten by the next pass).

No step reallocates the cache: a verify pass costs one in-place write per layer, a commit one gather.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_length: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H, S, hd]
        self.length = 0
        self.max_length = max_length

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

    def commit(self, n: int) -> None:
        """The first ``n`` scratch rows become context (they are already in place)."""
        self.reserve(n)
        self.length += n

    def commit_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep scratch rows ``rows`` (offsets from the scratch start, ascending) as the next context slots."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        n = rows.numel()
        if n == 0:
            return
        # A prefix 0..n-1 is already contiguous: skip the copy (the common case for chains).
        if not torch.equal(rows, torch.arange(n, device=rows.device)):
            src = self.length + rows
            dst = slice(self.length, self.length + n)
            # index_select materialises the gathered rows first, so overlapping src/dst ranges are safe.
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget context beyond ``length`` (used to roll back, e.g. in tests)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
