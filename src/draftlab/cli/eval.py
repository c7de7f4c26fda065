"""``draftlab-eval``: a benchmark for one method and the AR baseline on the same prompts (``conf/eval.yaml``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftlab.cli import config_dir, report_user_errors


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="eval")
@report_user_errors
def main(cfg: DictConfig) -> None:
    from draftlab.stages.pipeline import run_pipeline

    run_pipeline(cfg, stage="eval")


if __name__ == "__main__":
    main()
