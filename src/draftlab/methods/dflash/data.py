"""DFlash batches: the conversation DataModule, optionally carrying stored target features ``aux``.

Online batches are ``input_ids / attention_mask / loss_mask [B, T]``. With ``feature_dir`` (a store
written by ``draftlab.data.features``, one safetensors file per sample holding ``aux [T,
n_taps*d]``, keyed by the tapped layers, so every method tapping the same layers shares it), batches
also carry ``aux [B, T, n_taps*d]``, right-padded with zeros. DFlash trains on tokens, so the store's
``last`` hidden states are not loaded into the batch.
"""

from __future__ import annotations

from draftlab.data.feature_batches import FeatureDataModule


class DFlashDataModule(FeatureDataModule):
    """``FeatureDataModule`` with the tapped states only (DFlash trains on tokens, not target logits)."""

    fields = {"aux": "aux"}
