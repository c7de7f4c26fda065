"""Verify-shaped passes of a target, for measuring what a pass of k rows costs: the row-kernel choice
(``HFTarget.row_kernels``), the engine's cost model (``decoding.cost``) and the benchmarks."""

from __future__ import annotations

import torch


def binary_tree_mask(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A balanced binary tree of ``k`` nodes (node i's parent is (i - 1) // 2): (depth [k], ancestor mask
    [k, k], True where the row's node is the column's node or descends from it)."""
    depth = torch.zeros(k, dtype=torch.long)
    mask = torch.eye(k, dtype=torch.bool)
    for i in range(1, k):
        parent = (i - 1) // 2
        depth[i] = depth[parent] + 1
        mask[i] |= mask[parent]
    return depth, mask


def verify_passes(target, rows: tuple[int, ...], *, context: int = 128) -> list:
    """One closure per row count, each running a verify-shaped pass of that many rows over a ``context``-token
    prefix: tree rows at the positions after the prefix, an ancestor mask (a balanced binary tree) over the
    committed prefix plus the tree, a scratch region of the cache that the next pass overwrites. Every input
    is on the target's device, as the engine's are."""
    vocab, dev = target.geometry.vocab_size, target.device
    prompt = (torch.arange(context, device=dev) * 7919 % max(vocab - 1, 1) + 1)[None]  # [1, context] arbitrary
    cache = target.new_cache(1, context + max(rows) + 1)
    with torch.no_grad():  # as the engine runs: inference mode would make a compiled target guard apart
        target.forward(prompt, cache=cache)
    cache.commit(context)
    calls = []
    for k in rows:
        depth, tree_mask = binary_tree_mask(k)  # built on the host, then moved once, as the engine's are
        mask = torch.cat([torch.ones(k, context, dtype=torch.bool), tree_mask], 1).to(dev)  # [k, context + k]
        tokens = (torch.arange(k) * 31 % max(vocab - 1, 1) + 1).to(dev)[None]  # [1, k] arbitrary
        positions = (context + depth).to(dev)  # [k]
        calls.append(lambda t=tokens, m=mask, p=positions: target.forward(t, p, cache, m))
    return calls
