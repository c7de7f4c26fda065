"""Bytes saved for backward by the soft cross-entropy reference vs the chunked path (N = 4*2048, V = 32000).

Counts every tensor autograd saves (saved_tensors_hooks), once per storage: a deterministic measure of the
memory a training step keeps between forward and backward. Run: python experiments/ttt_kernels/soft_ce_memory.py
"""

from __future__ import annotations

import torch

from draftlab.kernels.soft_cross_entropy import soft_cross_entropy


def saved_bytes(impl: str, n: int = 4 * 2048, v: int = 32000) -> int:
    """Total bytes of the distinct storages saved for backward by one forward of ``impl``."""
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    target = torch.softmax(torch.randn(n, v), -1).to(torch.bfloat16)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = soft_cross_entropy(logits, target, impl=impl)
    loss.sum().backward()
    # the inputs are held by the caller anyway: count only what the op adds
    inputs = {logits.untyped_storage().data_ptr(), target.untyped_storage().data_ptr()}
    return sum(b for ptr, b in seen.items() if ptr not in inputs)


if __name__ == "__main__":
    ref, chunked = saved_bytes("torch"), saved_bytes("chunked")
    print(f"saved for backward beyond the inputs: reference {ref / 2**20:.1f} MiB, chunked {chunked / 2**20:.3f} MiB, "
          f"ratio {ref / max(chunked, 1):.0f}x")
