"""``draftlab-data``: run the data stage (see ``conf/data_stage.yaml``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftlab.cli import config_dir, report_user_errors


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="data_stage")
@report_user_errors
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.data import run_data_stage, write_summary

    result = run_data_stage(cfg, MethodSpec(cfg.method))
    path = write_summary(result, HydraConfig.get().runtime.output_dir)
    print(f"data summary: {path}")


if __name__ == "__main__":
    main()
