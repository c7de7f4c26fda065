"""DFlash batches: the conversation DataModule, optionally carrying stored target features ``aux``.

Online batches are ``input_ids / attention_mask / loss_mask [B, T]``. With ``feature_dir`` (a store
written by ``draftlab.data.features``, one safetensors file per sample holding ``aux [T,
n_taps*d]``, keyed by the tapped layers, so every method tapping the same layers shares it), batches
also carry ``aux [B, T, n_taps*d]`` and the store's final-norm states ``last_hidden [B, T, d]``, right-padded with
zeros: DFlash's own loss trains on tokens, a soft term of the loss menu on the target's distribution, which the
module computes from ``last_hidden`` (``methods/dflash/objective.py``).
"""

from __future__ import annotations

from draftlab.data.feature_batches import FeatureDataModule


class DFlashDataModule(FeatureDataModule):
    """``FeatureDataModule`` with the tapped states and the final states (the loss menu's teacher)."""

    fields = {"aux": "aux", "last": "last_hidden"}
