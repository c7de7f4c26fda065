"""Offline target features: the frozen target's aux hidden states and final hidden state, computed once.

Online training runs the target inside every step; offline training reads what this module wrote:
one safetensors file per sample (``aux [T, n_taps*d_t]`` for the layers a draft taps, ``last [T, d]`` =
the final post-norm hidden state), under a directory keyed by the content hash of everything that determines them (target,
tapped layers, data, dtype). Logits are rebuilt at training time from ``last`` with the target's LM head,
as SpecForge does, because storing ``[T, V]`` logits would cost V/(4d) times more disk.

Writing is resumable: each file is written to a temporary name and renamed, files that exist are
skipped, and ``complete.json`` marks a finished store. Several training runs (a TTT-length sweep, a
method comparison) share one store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from draftlab.data.template import RenderedSample
from draftlab.targets.base import PassRequest
from draftlab.utils.atomic import atomic_write_text
from draftlab.utils.hashing import content_key
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

_COMPLETE = "complete.json"


def feature_key(target_id, data_key: str, aux_layer_ids: Sequence[int], layer_convention: str,
                dtype: str, num_samples: int) -> str:
    """Content key of a feature store (``target_id`` is the resolved target config)."""
    return content_key("target-features/1", target_id, data_key, list(aux_layer_ids), str(layer_convention),
                       dtype, num_samples)


def store_dtype_name(dtype: str, target) -> str:
    """``auto``: the target's own dtype (bf16 features for a bf16 target: fp32 would double the store and add
    nothing the target computed); otherwise ``dtype`` itself."""
    if str(dtype) != "auto":
        return str(dtype)
    return str(getattr(target, "dtype", torch.float32)).removeprefix("torch.")


def offline_features(*, target, draft, samples: Sequence[RenderedSample], root: str | Path, key: tuple,
                     dtype: str = "auto") -> Path:
    """The registry's ``features`` entry: the store of the layers ``draft`` taps, under ``root/features/<key>``.

    ``key`` identifies the target (capture settings excluded) and the data; the tapped layers and the
    dtype (``auto``: the target's) are added here, so drafts that tap the same layers share one store.
    """
    dtype = store_dtype_name(dtype, target)
    layers = draft.taps(target)
    convention = getattr(target.layer_convention, "value", str(target.layer_convention))
    target_id, data_key = key
    fkey = feature_key(target_id, data_key, layers, convention, dtype, len(samples))
    return precompute_features(target, samples, Path(root) / "features" / fkey, dtype=dtype, aux_layer_ids=layers)


def _sample_path(root: Path, index: int) -> Path:
    return root / f"{index:07d}.safetensors"


def is_complete(root: str | Path) -> bool:
    return (Path(root) / _COMPLETE).exists()


@torch.no_grad()
def precompute_features(target, samples: Sequence[RenderedSample], root: str | Path, *, dtype: str = "float32",
                        max_tokens_per_batch: int = 4096, aux_layer_ids: Sequence[int] | None = None) -> Path:
    """Write ``aux``/``last`` for every sample under ``root`` (skipping files already there).

    Samples are run in length-sorted batches of at most ``max_tokens_per_batch`` padded tokens; each row is
    computed with right padding and a causal mask, so padding never reaches a real token.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if is_complete(root):
        return root
    store_dtype = getattr(torch, dtype)
    todo = [i for i in range(len(samples)) if not _sample_path(root, i).exists()]
    check_room(root, [len(samples[i].input_ids) for i in todo], _row_width(target, aux_layer_ids), store_dtype)
    if len(todo) < len(samples):
        log.info("feature store %s: resuming, %d of %d samples already written", root, len(samples) - len(todo),
                 len(samples))
    todo.sort(key=lambda i: -len(samples[i].input_ids))
    bar = tqdm(total=sum(len(samples[i].input_ids) for i in todo), desc="target features", unit="tok")
    start = 0
    while start < len(todo):
        width = len(samples[todo[start]].input_ids)
        n = max(1, min(len(todo) - start, max_tokens_per_batch // max(1, width)))
        batch = todo[start : start + n]
        start += n
        ids = torch.full((len(batch), width), 0, dtype=torch.long)  # [B, T]
        for row, i in enumerate(batch):
            ids[row, : len(samples[i].input_ids)] = torch.tensor(samples[i].input_ids)
        taps = True if aux_layer_ids is None else list(aux_layer_ids)  # True: the target's default taps
        out = target.forward(ids.to(target.device),
                             request=PassRequest(aux=taps, last_hidden=True, logits_rows=torch.arange(0)))
        for row, i in enumerate(batch):
            t = len(samples[i].input_ids)
            tensors = {"aux": out.aux_hidden[row, :t].to(store_dtype).contiguous().cpu(),  # [T, 3*d_t]
                       "last": out.last_hidden[row, :t].to(store_dtype).contiguous().cpu()}  # [T, d]
            path = _sample_path(root, i)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(tensors, str(tmp), metadata={"id": samples[i].id, "length": str(t)})
            os.replace(tmp, path)
            bar.update(t)
    bar.close()
    # Written last, and atomically: its presence is what marks the store complete.
    atomic_write_text(root / _COMPLETE, json.dumps({"num_samples": len(samples), "dtype": dtype}))
    return root


def _row_width(target, aux_layer_ids: Sequence[int] | None) -> int:
    """Values stored per token: the tapped layers' states plus the final one (``aux`` and ``last``)."""
    d = target.geometry.hidden_size
    taps = len(aux_layer_ids) if aux_layer_ids is not None else len(getattr(target, "aux_layer_ids", [])) or 3
    return (taps + 1) * d


def check_room(root: Path, lengths: Sequence[int], row_width: int, dtype: torch.dtype) -> int:
    """Log what the samples still to write will take on disk, and refuse (one line) when the free space under
    ``root`` is smaller: better now than a full disk hours into the extraction. Returns the bytes."""
    import shutil

    tokens = int(sum(lengths))
    per_token = row_width * dtype.itemsize
    need = tokens * per_token
    free = shutil.disk_usage(root).free
    log.info("feature store %s: %d samples to write, %d tokens x %d values x %s = %.2f GiB (%.2f GiB free)", root,
             len(lengths), tokens, row_width, str(dtype).removeprefix("torch."), need / 2**30, free / 2**30)
    if need > free:
        raise OSError(f"feature store {root}: {len(lengths)} samples need about {need / 2**30:.1f} GiB "
                      f"({tokens} tokens x {per_token} bytes) but {free / 2**30:.1f} GiB are free; free space, "
                      f"point paths.cache_dir elsewhere or store a narrower dtype (method.features.dtype)")
    return need


def load_sample_features(root: str | Path, index: int, expected_length: int) -> dict[str, torch.Tensor]:
    """``{"aux", "last"}`` of sample ``index``; a missing, corrupt or mismatched file raises a clear error."""
    path = _sample_path(Path(root), index)
    try:
        tensors = load_file(str(path))
    except (FileNotFoundError, SafetensorError, OSError) as exc:
        raise RuntimeError(f"feature file {path} is missing or corrupt ({exc}); delete it and re-run to "
                           "recompute it") from exc
    if tensors["aux"].shape[0] != expected_length:
        raise RuntimeError(f"feature file {path} holds {tensors['aux'].shape[0]} rows but sample {index} has "
                           f"{expected_length} tokens: the store does not belong to this data")
    return tensors


class FeatureDataset(Dataset):
    """Rendered samples paired with their stored features (the i-th sample reads ``{i:07d}.safetensors``)."""

    def __init__(self, samples: Sequence[RenderedSample], root: str | Path, indices: Sequence[int] | None = None):
        self.samples = list(samples)
        self.root = Path(root)
        self.indices = list(indices) if indices is not None else list(range(len(self.samples)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[RenderedSample, dict[str, torch.Tensor]]:
        s = self.samples[i]
        return s, load_sample_features(self.root, self.indices[i], len(s.input_ids))
