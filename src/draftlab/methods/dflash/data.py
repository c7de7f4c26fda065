"""DFlash batches: the conversation DataModule, optionally carrying stored target features ``aux``.

Online batches are ``input_ids / attention_mask / loss_mask [B, T]``. With ``feature_dir`` (a store
written by ``draftlab.data.features``, one safetensors file per sample holding ``aux [T,
n_taps*d]``, keyed by the tapped layers, so every method tapping the same layers shares it), batches
also carry ``aux [B, T, n_taps*d]``, right-padded with zeros. DFlash trains on tokens, so the store's
``last`` hidden states are not loaded into the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftlab.data.datamodule import ConversationDataModule, PadCollator
from draftlab.data.features import FeatureDataset
from draftlab.data.template import RenderedSample


class AuxPadCollator:
    """Right-pads tokens (as ``PadCollator``) and the stored ``aux`` features (zeros) to the longest sample."""

    def __init__(self, pad_token_id: int) -> None:
        self.tokens = PadCollator(pad_token_id)

    def __call__(self, batch: Sequence[tuple[RenderedSample, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        out = self.tokens([s for s, _ in batch])
        B, T = out["input_ids"].shape
        first = batch[0][1]["aux"]
        aux = torch.zeros(B, T, first.shape[-1], dtype=first.dtype)  # [B, T, n_taps*d]
        for row, (_, feats) in enumerate(batch):
            aux[row, : feats["aux"].shape[0]] = feats["aux"]
        out["aux"] = aux
        return out


class DFlashDataModule(ConversationDataModule):
    """``ConversationDataModule`` whose batches carry ``aux`` when ``feature_dir`` is set.

    ``feature_dir`` may be a callable returning the directory, evaluated at loader time (after the
    features exist), so the module can be configured before the store is written.
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
        return AuxPadCollator(self.pad_token_id)
