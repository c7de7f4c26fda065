"""Batches that carry stored target features next to the tokens, for any method with an offline store.

``FeatureDataModule`` is the conversation DataModule whose batches also hold the features of a store written
by ``draftlab.data.features`` (one safetensors file per sample) when ``feature_dir`` is set. A method says
which stored tensors it wants and under which batch keys (``fields``); EAGLE-3 takes ``aux`` and ``last``,
DFlash only ``aux``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftlab.data.datamodule import ConversationDataModule, PadCollator
from draftlab.data.features import FeatureDataset
from draftlab.data.template import RenderedSample


class FeaturePadCollator:
    """Right-pads tokens (as ``PadCollator``) and the stored features named in ``fields`` (store name ->
    batch key) with zeros to the longest sample."""

    def __init__(self, pad_token_id: int, fields: Mapping[str, str]) -> None:
        self.tokens = PadCollator(pad_token_id)
        self.fields = dict(fields)

    def __call__(self, batch: Sequence[tuple[RenderedSample, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        out = self.tokens([s for s, _ in batch])
        B, T = out["input_ids"].shape
        for name, key in self.fields.items():
            first = batch[0][1][name]
            padded = torch.zeros(B, T, first.shape[-1], dtype=first.dtype)  # [B, T, w]
            for row, (_, feats) in enumerate(batch):
                padded[row, : feats[name].shape[0]] = feats[name]
            out[key] = padded
        return out


class FeatureDataModule(ConversationDataModule):
    """``ConversationDataModule`` whose batches carry the stored ``fields`` when ``feature_dir`` is set.

    ``feature_dir`` may be a callable returning the directory, evaluated at loader time (after the features
    exist), so the module can be configured before the store is written. Subclasses set ``fields``.
    """

    fields: Mapping[str, str] = {"aux": "aux"}

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
        return FeaturePadCollator(self.pad_token_id, self.fields)
