"""Reduced draft vocabulary (``d2t`` / ``t2d``), built exactly as EAGLE-3, SpecForge and SGLang expect.

The draft head predicts over ``V_d`` ids: the ``V_d`` target tokens seen most often in the loss-masked
(assistant) positions of the training data, in ascending target-id order. Two buffers describe it:

* ``d2t[i] = S[i] - i`` (int64, length ``V_d``): an offset, so ``target_id = draft_id + d2t[draft_id]``;
  serving engines rebuild the hot-token list as ``d2t + arange(V_d)``.
* ``t2d[v] = v in S`` (bool, length ``V``): which target tokens the draft can emit; a training-time mask.

The mapping depends on the data, template, tokenizer and maximum length, so it is cached under a key
hashed from all of them (EAGLE's single ``cache.pt`` is silently reused across datasets).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftlab.data.errors import DataError
from draftlab.data.template import RenderedSample
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class VocabMapping:
    """Draft <-> target vocabulary mapping: ``d2t`` offsets, ``t2d`` membership mask, and data coverage."""

    d2t: torch.Tensor  # [V_d] int64
    t2d: torch.Tensor  # [V] bool
    coverage: float

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id, in draft order (SGLang's ``hot_token_id``)."""
        return self.d2t + torch.arange(self.d2t.numel(), dtype=self.d2t.dtype)  # [V_d]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft ids (any shape) to target ids."""
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]


def token_frequencies(samples: Iterable[RenderedSample], vocab_size: int) -> torch.Tensor:
    """Count each token id over loss-masked positions only (what the draft head must predict)."""
    freq = torch.zeros(vocab_size, dtype=torch.long)  # [V]
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.long)  # [T]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)  # [T]
        picked = ids[mask]
        if picked.numel() and int(picked.max()) >= vocab_size:
            raise DataError(
                f"token id {int(picked.max())} >= vocab_size {vocab_size}", field=f"sample {s.id!r}"
            )
        freq += torch.bincount(picked, minlength=vocab_size)
    return freq


def build_vocab_mapping(freq: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    """Build ``d2t``/``t2d`` from per-token counts (``[V]``) for a draft vocabulary of ``draft_vocab_size``.

    The ``draft_vocab_size`` most frequent ids are kept (ties go to the lower id, so the result does not
    depend on sort stability); when fewer distinct ids occur, the set is padded with the lowest unused
    ids, as SpecForge does. ``coverage`` is the share of counted occurrences the kept ids cover.
    """
    freq = torch.as_tensor(freq, dtype=torch.long).flatten()  # [V]
    vocab_size = freq.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    total = int(freq.sum())
    if total == 0:
        raise DataError("no loss-masked tokens to count; cannot choose a draft vocabulary")

    # Stable descending sort keeps ascending ids among equal counts.
    order = torch.sort(freq, descending=True, stable=True).indices  # [V]
    seen = int((freq > 0).sum())
    chosen = order[: min(draft_vocab_size, seen)]  # [<=V_d]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[chosen] = True
    if chosen.numel() < draft_vocab_size:
        unused = (~t2d).nonzero().flatten()  # ascending
        t2d[unused[: draft_vocab_size - chosen.numel()]] = True
    selected = t2d.nonzero().flatten()  # [V_d], ascending target ids
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)  # [V_d]
    coverage = float(freq[selected].sum()) / total
    log.info("top %d token frequency ratio: %.2f%%", draft_vocab_size, 100 * coverage)
    return VocabMapping(d2t=d2t, t2d=t2d, coverage=coverage)


def vocab_mapping_cache_key(
    data_fingerprint: str, template: str, tokenizer_name: str, max_length: int, draft_vocab_size: int
) -> str:
    """sha256 hex key over everything that changes which tokens land in the loss mask, and ``V_d``."""
    payload = json.dumps(
        {
            "data": data_fingerprint,
            "template": template,
            "tokenizer": tokenizer_name,
            "max_length": max_length,
            "draft_vocab_size": draft_vocab_size,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def vocab_mapping_path(cache_dir: str | Path, key: str) -> Path:
    """Where :func:`load_or_build_vocab_mapping` stores the mapping for ``key``."""
    return Path(cache_dir) / "vocab_mapping" / f"{key}.pt"


def load_or_build_vocab_mapping(
    samples_fn: Callable[[], Iterable[RenderedSample]],
    *,
    cache_dir: str | Path,
    key: str,
    vocab_size: int,
    draft_vocab_size: int,
) -> VocabMapping:
    """Load the mapping cached under ``key``, or build it from ``samples_fn()`` and cache it.

    ``samples_fn`` is only called on a cache miss, so rendering the data can be skipped entirely. A cached
    file whose shapes do not match ``vocab_size``/``draft_vocab_size`` is rebuilt, with a warning.
    """
    path = vocab_mapping_path(cache_dir, key)
    if path.exists():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        d2t, t2d = blob["d2t"], blob["t2d"]
        if d2t.numel() == draft_vocab_size and t2d.numel() == vocab_size:
            log.info("loaded vocab mapping %s (coverage %.2f%%)", path, 100 * float(blob["coverage"]))
            return VocabMapping(d2t=d2t, t2d=t2d, coverage=float(blob["coverage"]))
        log.warning("vocab mapping %s has the wrong shape; rebuilding it", path)

    mapping = build_vocab_mapping(token_frequencies(samples_fn(), vocab_size), draft_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename so a concurrent reader (another rank) never sees a partial file.
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"d2t": mapping.d2t, "t2d": mapping.t2d, "coverage": mapping.coverage, "key": key}, tmp)
    os.replace(tmp, path)
    log.info("saved vocab mapping to %s", path)
    return mapping
