"""``draftlab-train``: data -> training (reused / resumed by content key) -> export -> evaluation (``conf/train.yaml``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftlab.cli import config_dir, report_user_errors


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
@report_user_errors
def main(cfg: DictConfig) -> None:
    from draftlab.stages.pipeline import run_pipeline

    run_pipeline(cfg, stage="train")


if __name__ == "__main__":
    main()
