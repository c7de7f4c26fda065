"""``draftlab-export``: write a trained EAGLE-3 draft in serving formats (see ``conf/export.yaml``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from draftlab.cli import config_dir, report_user_errors

# Embedded asset targets have no hub id of their own; vLLM loads the verifier by this name.
_HUB_NAMES = {"asset:smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", ["LlamaForCausalLM"])}


def run_export(cfg: DictConfig) -> dict:
    """Map the composed config onto ``draftlab.export.export_checkpoint``; returns ``{format: dir}``."""
    from hydra.utils import instantiate

    from draftlab.export import export_checkpoint

    source = str(cfg.target.get("source", ""))
    hub_name, hub_arch = _HUB_NAMES.get(source, (None, None))
    if hub_name is None and source and not source.startswith("asset:") and source != "tiny_random":
        hub_name = source
    verifier_arch = cfg.get("verifier_architectures")
    return export_checkpoint(
        cfg.checkpoint, cfg.output_dir, format=cfg.format, dtype=cfg.get("dtype"),
        include_embedding=bool(cfg.include_embedding),
        # Built only if the embedding must be written and the checkpoint lacks it.
        target=lambda: instantiate(cfg.target),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        verifier_name_or_path=cfg.get("verifier_name_or_path") or hub_name,
        verifier_architectures=OmegaConf.to_container(verifier_arch) if verifier_arch is not None else hub_arch,
        speculative_tokens=int(cfg.speculative_tokens), validate=bool(cfg.validate))


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="export")
@report_user_errors
def main(cfg: DictConfig) -> None:
    for fmt, path in run_export(cfg).items():
        print(f"{fmt} export: {path}")


if __name__ == "__main__":
    main()
