"""``draftlab-export``: write a trained draft in its method's serving formats (see ``conf/export.yaml``).

``method=<m>`` (default eagle3) picks the formats, the writers and the validators: the method's ``export``
block in ``conf/method/<m>.yaml``; this module only maps the command line onto ``draftlab.export``."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from draftlab.cli import config_dir, report_user_errors
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

# Embedded asset targets have no hub id of their own; vLLM loads the verifier by this name.
_HUB_NAMES = {"asset:smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", ["LlamaForCausalLM"])}


def target_config(source: str):
    """The target's HF config without its weights: the ``config.json`` directory of an embedded asset or a local
    directory, or a hub id's config (from the cache, or the hub where reachable). None where only building the
    target tells (``tiny_random``) or the config cannot be had; ``export_checkpoint`` then builds the target."""
    if not source or source == "tiny_random":
        return None
    if source.startswith("asset:"):
        from draftlab.assets import fetch

        return fetch(source.removeprefix("asset:"))
    if (Path(source) / "config.json").is_file():
        return Path(source)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source)
    except Exception as e:  # offline, gated, or not a model id: fall back to the target itself
        log.warning("cannot read the config of target %s (%s: %s); building the target for its context length",
                    source, type(e).__name__, e)
        return None


def run_export(cfg: DictConfig) -> dict:
    """Map the composed config onto ``draftlab.export.export_checkpoint``; returns ``{format: dir}``."""
    from hydra.utils import instantiate

    from draftlab.export import export_checkpoint
    from draftlab.methods.registry import MethodSpec

    source = str(cfg.target.get("source", ""))
    hub_name, hub_arch = _HUB_NAMES.get(source, (None, None))
    if hub_name is None and source and not source.startswith("asset:") and source != "tiny_random":
        hub_name = source
    verifier_arch = cfg.get("verifier_architectures")
    explicit_positions = cfg.get("max_position_embeddings")
    # Each setting reaches the writers that take it (the EAGLE-3 ones read them all; DFlash's dtype and
    # max_position_embeddings).
    return export_checkpoint(
        MethodSpec(cfg.method), cfg.checkpoint, cfg.output_dir, format=str(cfg.format), validate=bool(cfg.validate),
        # Built only where the method needs it: EAGLE-3 for an embedding the checkpoint lacks or for the
        # context length when the target's config.json cannot be read; methods that share the target's
        # weights (DFlash) always.
        target=lambda: instantiate(cfg.target),
        dtype=cfg.get("dtype"), include_embedding=bool(cfg.include_embedding),
        verifier_config=target_config(source) if explicit_positions is None else None,
        max_position_embeddings=explicit_positions,
        verifier_name_or_path=cfg.get("verifier_name_or_path") or hub_name,
        verifier_architectures=OmegaConf.to_container(verifier_arch) if verifier_arch is not None else hub_arch,
        speculative_tokens=int(cfg.speculative_tokens))


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="export")
@report_user_errors
def main(cfg: DictConfig) -> None:
    for fmt, path in run_export(cfg).items():
        print(f"{fmt} export: {path}")


if __name__ == "__main__":
    main()
