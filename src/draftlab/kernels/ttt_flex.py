"""TTT attention through ``torch.nn.attention.flex_attention`` (``ttt_attention(impl="flex")``): the TTT mask as a
``mask_mod`` over the concatenated keys ``[prefix T | step 1 M | ... | step k M]``. One fused kernel when compiled
(CUDA); its eager fallback materialises the scores. ``dk``, ``dv``: the stacked diagonal keys / values
``[B, Hkv, k, M, hd]``; the rest (a sliding ``window`` included: ``ttt_window.py``) as in ``ttt_attention``."""

from __future__ import annotations

import torch


def flex_ttt(q, k0, v0, dk, dv, scale, rows, key_mask, window=None):
    """The TTT mask as a flex_attention ``mask_mod`` over keys ``[prefix T | step 1 M | ... | step k M]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, M, hd = q.shape
    Hkv, T, n_diag = k0.shape[1], k0.shape[2], dk.shape[2]
    keys = torch.cat([k0, dk.flatten(2, 3)], dim=2)  # [B, Hkv, T + k*M, hd]
    values = torch.cat([v0, dv.flatten(2, 3)], dim=2)
    km = key_mask if key_mask is not None else torch.ones(1, T, dtype=torch.bool, device=q.device)

    def mask_mod(b, h, m, s):
        in_prefix = s < T
        sp = torch.clamp(s, max=T - 1)
        sees_prefix = (sp <= rows[m]) & km[b if key_mask is not None else 0, sp]
        own = (s - T) % M == m  # the row's own key of a later step
        if window is not None:  # step j = (s - T) // M + 1 of a row at index rows[m] + n_diag
            sees_prefix = sees_prefix & (sp > rows[m] + n_diag - window)
            own = own & ((s - T) // M + 1 > n_diag - window)
        return torch.where(in_prefix, sees_prefix, own)

    # Compiled on CUDA: the eager builder materialises a [M, T + k*M] mask (~7 GiB at T = 8k) on every call.
    mask = create_block_mask(mask_mod, B if key_mask is not None else None, None, M, T + n_diag * M,
                             device=q.device, _compile=q.device.type == "cuda")
    return _flex_kernel(q.device)(q, keys, values, block_mask=mask, scale=scale, enable_gqa=H != Hkv)


_COMPILED_FLEX = None


def _flex_kernel(device):
    """flex_attention is one fused kernel only when compiled (CUDA); eager, it materialises the scores."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if torch.device(device).type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX
