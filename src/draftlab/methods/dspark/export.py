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

import json
from pathlib import Path
from typing import Any

import torch

from draftlab.methods.dflash import export as dflash_export
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.methods.dspark.model import DSparkDraft
from draftlab.utils.atomic import atomic_dir

CONFIG_FILE, WEIGHTS_FILE = dflash_export.CONFIG_FILE, dflash_export.WEIGHTS_FILE
# Top-level keys fixed by how draftlab drafts (``config`` says why), as vLLM reads them.
FIXED_KEYS = {"confidence_head_with_markov": False, "sample_from_anchor": False}


def hf_config(c: DSparkConfig, *, torch_dtype: str, target=None, max_position_embeddings: int | None = None
              ) -> dict[str, Any]:
    """The ``config.json`` dict of a DSpark draft: DFlash's plus the DSpark keys at the top level."""
    out = dflash_export.hf_config(c, torch_dtype=torch_dtype, target=target,
                                  max_position_embeddings=max_position_embeddings)
    out.update(markov_rank=c.markov_rank, enable_confidence_head=c.enable_confidence_head,
               draft_vocab_size=c.vocab_size, **FIXED_KEYS)
    return out


def save(draft: DSparkDraft, out_dir: str | Path, *, target=None, dtype: str | torch.dtype | None = None,
         max_position_embeddings: int | None = None) -> Path:
    """Write ``draft`` as a vLLM DSpark directory at ``out_dir`` (atomically, validated) and return it.

    dtype      cast the floating weights (None keeps the draft's); ``target`` supplies positions and token ids.
    """
    from safetensors.torch import save_file

    from draftlab.targets.hf import resolve_dtype

    cast = resolve_dtype(dtype) if dtype is not None else None
    tensors = {}
    for key, t in draft.state_dict().items():
        t = t.detach().to("cpu")
        tensors[key] = (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous().clone()
    torch_dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    config = hf_config(draft.config, torch_dtype=torch_dtype, target=target,
                       max_position_embeddings=max_position_embeddings)
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        problems = validate(tmp, target=target)
        if problems:
            raise ValueError(f"refusing to write an invalid DSpark export to {out}:\n  - " + "\n  - ".join(problems))
    return out


def _check_dspark_keys(cfg: dict[str, Any], problems: list[str]) -> None:
    """The top-level keys vLLM's DSpark reads, against the ``dflash_config`` copy draftlab reads back."""
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    rank = cfg.get("markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"config.json 'markov_rank' must be an integer >= 1 (vLLM sizes the Markov head by it), "
                        f"got {rank!r}")
    elif dc.get("markov_rank", rank) != rank:
        problems.append(f"config.json 'markov_rank' {rank} disagrees with dflash_config markov_rank {dc['markov_rank']}")
    conf = cfg.get("enable_confidence_head")
    if not isinstance(conf, bool):
        problems.append(f"config.json 'enable_confidence_head' must be true or false, got {conf!r}")
    elif dc.get("enable_confidence_head", conf) != conf:
        problems.append(f"config.json 'enable_confidence_head' {conf} disagrees with dflash_config's")
    for key, want in FIXED_KEYS.items():
        if cfg.get(key) is not want:
            problems.append(f"config.json '{key}' must be {str(want).lower()} (draftlab's DSpark: see "
                            f"methods/dspark/config.py), got {cfg.get(key)!r}")
    vocab = cfg.get("draft_vocab_size")
    if vocab is not None and vocab != cfg.get("vocab_size"):
        problems.append(f"config.json 'draft_vocab_size' {vocab} != vocab_size {cfg.get('vocab_size')} (the draft "
                        "predicts through the target's full LM head)")


def validate(path: str | Path, *, target=None) -> list[str]:
    """Every problem vLLM's DSpark loader or draftlab would hit with the export at ``path`` (empty = valid):
    DFlash's checks (layers, taps, every tensor's name and shape, the heads' included) plus the DSpark keys."""
    path = Path(path)
    problems = dflash_export.validate(path, target=target, config_class=DSparkConfig)
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text()) if file.is_file() else None
    except json.JSONDecodeError:
        cfg = None  # DFlash's validate has said so
    if isinstance(cfg, dict):
        _check_dspark_keys(cfg, problems)
    return problems


def check_valid(path: str | Path, *, target=None) -> None:
    """``validate`` that raises ``ValueError`` listing the problems."""
    problems = validate(path, target=target)
    if problems:
        raise ValueError(f"{path} is not a valid DSpark export:\n  - " + "\n  - ".join(problems))


def load(path: str | Path, *, target, dtype: str | torch.dtype | None = None) -> DSparkDraft:
    """The draft saved at ``path`` (validated first), on ``target``'s device, sharing its embedding and LM head."""
    check_valid(path, target=target)
    return dflash_export.load(path, target=target, dtype=dtype, draft_class=DSparkDraft)
