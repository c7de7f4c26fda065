"""The sliding window of TTT attention (``ttt_attention(window=W)``): which keys a windowed row sees.

The row of TTT step k for prefix row t stands at index ``t + k`` (its RoPE position when positions count from 0),
so with window W it sees the step-0 keys ``t + k - W < s <= t`` and its own key of step j iff ``k - j < W``: the
convention of ``draftlab.nn.window`` (HF / vLLM ``sliding_window``), what a serving engine's draft KV cache gives
the same row. The ``torch``, ``blockwise`` and ``flex`` implementations apply it; Triton's kernels do not.
"""

from __future__ import annotations

import torch

WINDOWED_IMPLS = ("torch", "blockwise", "flex")


def windowed_impl(impl: str, window: int | None) -> str:
    """``impl`` (already resolved), checked to implement a sliding ``window`` when one is given (``window`` too)."""
    if window is None:
        return impl
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if impl not in WINDOWED_IMPLS:
        raise NotImplementedError(f"TTT attention '{impl}' has no sliding window: use {', '.join(WINDOWED_IMPLS)} "
                                  "(auto picks blockwise for a windowed draft)")
    return impl


def visible_steps(n_diag: int, window: int | None) -> range:
    """The diagonal entries ``i`` (step ``i + 1``) a row of step ``n_diag`` sees: those with ``n_diag - (i + 1) < W``."""
    return range(0 if window is None else max(0, n_diag - window), n_diag)


def key_blocks(rows: torch.Tensor, T: int, block: int, window: int | None, n_diag: int) -> range:
    """Starts of the prefix key blocks that query rows ``rows [bm]`` (of step ``n_diag``) can see: none past the last
    row's own key, none wholly before the first row's window."""
    lo = 0 if window is None else max(0, int(rows.min()) + n_diag - window + 1) // block * block
    return range(lo, min(T, int(rows.max()) + 1), block)
