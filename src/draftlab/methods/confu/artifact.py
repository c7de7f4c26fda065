"""A trained ConFu draft on disk: ``config.json`` (the full ConFuConfig) + ``model.safetensors``.

No serving engine loads ConFu yet, so this is draftlab's own format: every weight except the frozen
embedding, which is copied back from the target on load (as for EAGLE-3 checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftlab.methods.confu.config import ConFuConfig
from draftlab.methods.confu.model import ConFuDraft
from draftlab.nn.placement import target_device

FORMAT = "draftlab-confu/1"


def save_confu(draft: ConFuDraft, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"format": FORMAT, "config": draft.config.to_dict()}, indent=2))
    return out


def is_confu_artifact(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.exists() and json.loads(cfg.read_text()).get("format") == FORMAT


def load_confu(path: str | Path, *, target, device: torch.device | str | None = None) -> ConFuDraft:
    """Rebuild the draft on ``device`` (default: the target's); the embedding comes from ``target``. Missing or
    extra tensors raise, naming them."""
    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}/config.json is not a {FORMAT} artifact (format={meta.get('format')!r})")
    draft = ConFuDraft(ConFuConfig.from_dict(meta["config"])).to(target_device(target, device))
    tensors = load_file(str(path / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"{path}/model.safetensors does not match the config: missing {missing}, unexpected {unexpected}")
    draft.load_target_embedding(target)
    return draft


# ---- registry entries (conf/method/confu.yaml) -------------------------------------------------------


def build_draft(*, target, vocab=None, taps: list[int] | None = None, init: dict | None = None,
                **fields) -> ConFuDraft:
    """The registry's ``draft`` builder: ``model.build_confu_draft`` with the method's taps.

    ``init.from`` (on-policy training continues a trained draft): a ConFu artifact is continued as it is
    (a configured field that disagrees with it raises); anything else is an EAGLE-3 start, as ``init_from``.
    """
    from draftlab.methods.confu.model import build_confu_draft
    from draftlab.targets.base import default_aux_layer_ids

    fields = {k: v for k, v in fields.items() if v is not None}
    if (init or {}).get("lm_head", "random") != "random":
        raise ValueError(f"method.draft.init.lm_head={init['lm_head']}: a ConFu draft's LM head starts random "
                         "(or from the EAGLE-3 draft in init.from)")
    start = (init or {}).get("from")
    if start is not None and is_confu_artifact(start):
        draft = load_confu(start, target=target)
        clash = {k: (v, getattr(draft.config, k, None)) for k, v in fields.items()
                 if k != "init_from" and getattr(draft.config, k, None) != v}
        if clash:
            raise ValueError(f"method.draft.init.from={start} disagrees with method.draft (configured, loaded): {clash}")
        return draft
    if start is not None:
        fields["init_from"] = start
    if fields.get("init_from") is None:
        fields["aux_layer_ids"] = list(taps) if taps is not None else default_aux_layer_ids(
            target.geometry.num_layers, target.layer_convention)
    return build_confu_draft(target, vocab_mapping=vocab, **fields)


def save_artifact(draft: ConFuDraft, out_dir: str | Path, *, target) -> Path:
    return save_confu(draft, out_dir)


def load_artifact(path: str | Path, *, target) -> ConFuDraft:
    return load_confu(path, target=target)
