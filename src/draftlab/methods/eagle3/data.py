"""EAGLE-3 batches: the conversation DataModule, optionally paired with offline target features."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftlab.data.datamodule import ConversationDataModule, PadCollator
from draftlab.data.features import FeatureDataset
from draftlab.data.template import RenderedSample


class FeaturePadCollator:
    """Right-pads tokens (as ``PadCollator``) and the stored ``aux``/``last`` features with zeros."""

    def __init__(self, pad_token_id: int) -> None:
        self.tokens = PadCollator(pad_token_id)

    def __call__(self, batch: Sequence[tuple[RenderedSample, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        out = self.tokens([s for s, _ in batch])
        B, T = out["input_ids"].shape
        for name, key in (("aux", "aux_hidden"), ("last", "last_hidden")):
            width = batch[0][1][name].shape[-1]
            padded = torch.zeros(B, T, width, dtype=batch[0][1][name].dtype)  # [B, T, w]
            for row, (_, feats) in enumerate(batch):
                padded[row, : feats[name].shape[0]] = feats[name]
            out[key] = padded
        return out


class Eagle3DataModule(ConversationDataModule):
    """``ConversationDataModule`` whose batches carry offline features when ``feature_dir`` is set.

    ``feature_dir`` may be a callable returning the directory, evaluated in ``setup`` (after the
    features have been computed), so the module can be configured before the store exists.
    """

    def __init__(self, samples, feature_dir: str | Path | Callable[[], str | Path] | None = None, **kwargs) -> None:
        super().__init__(samples, **kwargs)
        self._feature_dir = feature_dir

    @property
    def feature_dir(self) -> Path | None:
        fd = self._feature_dir() if callable(self._feature_dir) else self._feature_dir
        return Path(fd) if fd is not None else None

    def _dataset(self, samples: list[RenderedSample], indices: list[int]) -> Dataset:
        if self.feature_dir is None:
            return super()._dataset(samples, indices)
        return FeatureDataset(samples, self.feature_dir, indices)

    def _collator(self) -> Callable:
        if self.feature_dir is None:
            return super()._collator()
        return FeaturePadCollator(self.pad_token_id)
