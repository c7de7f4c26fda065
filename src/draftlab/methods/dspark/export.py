"""The vLLM DSpark format (``Qwen3DSparkModel``, ``--speculative-config '{"method": "dspark", ...}'``).

DFlash's HF directory (``methods.dflash.export``: Qwen3 layer sizes, ``dflash_config``, the draft's own
weights without the target's embedding / LM head) with

- ``architectures: ["Qwen3DSparkModel"]``, which makes vLLM pick its DSpark speculator;
- the top-level keys vLLM's ``Qwen3DSparkModel`` and ``DSparkSpeculator`` read: ``markov_rank``,
  ``enable_confidence_head``, ``confidence_head_with_markov: false`` (the head reads the slot state only),
  ``sample_from_anchor: false`` (DFlash's fill-in block: the bonus token's query, then mask queries) and
  ``draft_vocab_size`` (the full vocabulary: the LM head is the target's);
- the heads' tensors ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [V, r]`` and,
  with the confidence head, ``confidence_head.proj.weight [1, d]`` / ``confidence_head.proj.bias [1]``.

``block_size`` keeps DFlash's meaning (anchor + proposals); a served chain of k tokens is a block of k + 1
slots, as for DFlash (``chain_knobs``), so vLLM is given ``num_speculative_tokens`` explicitly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftlab.methods.dflash import export as dflash_export
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.methods.dspark.model import DSparkDraft

# DFlash's writer: config.json gains the DSpark keys through ``DSparkConfig.extra_hf_keys``, and the written
# directory is checked by DFlash's validator with ``DSparkConfig`` (its tensors and ``check_hf_keys``).
save = dflash_export.save


def validate(path: str | Path, *, target=None) -> list[str]:
    """Every problem vLLM's DSpark loader or draftlab would hit with the export at ``path`` (empty = valid):
    DFlash's checks (layers, taps, every tensor's name and shape, the heads' included) plus the DSpark keys."""
    return dflash_export.validate(path, target=target, config_class=DSparkConfig)


def load(path: str | Path, *, target, dtype: str | torch.dtype | None = None) -> DSparkDraft:
    """The draft saved at ``path`` (validated first), on ``target``'s device, sharing its embedding and LM head."""
    return dflash_export.load(path, target=target, dtype=dtype, draft_class=DSparkDraft)
