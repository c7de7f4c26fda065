"""EAGLE-3 batches: the conversation DataModule, optionally paired with offline target features.

With ``feature_dir`` the batches also carry ``aux_hidden [B, T, 3*d_t]`` and ``last_hidden [B, T, d_t]``
(the target's final hidden states, turned into logits with its LM head by the module).
"""

from __future__ import annotations

from draftlab.data.feature_batches import FeatureDataModule


class Eagle3DataModule(FeatureDataModule):
    """``FeatureDataModule`` with the tapped states and the final hidden state of every position."""

    fields = {"aux": "aux_hidden", "last": "last_hidden"}
