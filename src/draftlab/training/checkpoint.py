"""Reading a Lightning training checkpoint and its draft weights, for any method (export and methods alike).

Every method's training module holds its draft under the ``draft`` attribute, so ``ckpt["state_dict"]``
holds ``draft.<name>`` for each of the draft's own tensors (torch.compile inserts ``_orig_mod.``).

Checkpoints are read with torch's ``weights_only`` unpickler, which builds tensors and plain containers and
nothing else: a pickle that would construct other objects (and with them run code) is refused. draftlab's own
checkpoints need nothing more (the training stage's ``PlainCheckpoint`` keeps them so, with :func:`plain`). A file that does need a full pickle is read
only when the user says they trust it (``trust_checkpoint=true``, which the entry points pass to
:func:`trust_checkpoints`), or when it lies in the run's own artifact directory, which draftlab wrote
(``trusted=True`` from the training stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.utils.errors import ArtifactError

DRAFT_PREFIX = "draft."
_COMPILED = "_orig_mod."
_TRUSTED = {"all": False}  # trust_checkpoint=true: read pickles that need more than tensors (the user's call)


def trust_checkpoints(enabled: bool) -> None:
    """Read every checkpoint of this process with the full unpickler when it needs one (the entry points set it
    from ``trust_checkpoint``)."""
    _TRUSTED["all"] = bool(enabled)


def unsafe_objects(path: str | Path) -> list[str]:
    """The Python objects (``module.name``) a checkpoint's pickle would build besides tensors and containers."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    return list(get_unsafe_globals_in_checkpoint(str(path)))


def load_file(path: str | Path, *, trusted: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` on the CPU with the ``weights_only`` unpickler, or the full one where the file
    needs it and is trusted (``trusted``: the run's own artifact; or :func:`trust_checkpoints`); otherwise an
    ``ArtifactError`` naming the objects the file would build and ``trust_checkpoint=true``."""
    try:
        needs = unsafe_objects(path)
    except Exception as e:  # not a torch zip at all (truncated, foreign): the reader below says what it is
        needs = []
        del e
    if needs and not (trusted or _TRUSTED["all"]):
        shown = ", ".join(needs[:4]) + (", ..." if len(needs) > 4 else "")
        raise ArtifactError(f"loading needs Python objects beyond tensors ({shown}), which a pickle can use to run "
                            "code; if you trust the file, pass trust_checkpoint=true", file=Path(path))
    return torch.load(path, map_location="cpu", weights_only=not needs, mmap=mmap)


def read_checkpoint(path: str | Path, *, mmap: bool = False, trusted: bool = False) -> dict[str, Any]:
    """The checkpoint dict (:func:`load_file`); ``ArtifactError`` naming the file for a truncated, corrupt or
    foreign file, or one that needs an untrusted pickle."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt: Any = load_file(path, trusted=trusted, mmap=mmap)
    except ArtifactError:
        raise
    except Exception as e:  # truncated zips, bad pickles and short reads raise unrelated types
        raise ArtifactError(f"cannot read Lightning checkpoint (truncated or corrupt?): {type(e).__name__}: {e}",
                            file=path) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ArtifactError("not a Lightning checkpoint (no 'state_dict')", file=path)
    return ckpt


def draft_state(ckpt: dict[str, Any], path: str | Path) -> dict[str, torch.Tensor]:
    """The draft's tensors of a checkpoint dict, under the draft's own names."""
    tensors = {key.removeprefix(DRAFT_PREFIX).replace(_COMPILED, ""): t for key, t in ckpt["state_dict"].items()
               if key.startswith(DRAFT_PREFIX)}
    if not tensors:
        raise ArtifactError(f"state_dict has no '{DRAFT_PREFIX}*' entries", file=Path(path))
    return tensors


def plain(value: Any) -> Any:
    """``value`` with every OmegaConf container (hyper-parameters straight from a config) made a plain dict or
    list, so a checkpoint holding it loads with the ``weights_only`` unpickler."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return type(value)((k, plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
