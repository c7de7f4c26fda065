"""One name per concept (README "Glossary"): the current names compose, and every retired spelling is refused
with one line naming the new one — on the command line (before Hydra composes), in an experiment's
``method_overrides`` block, inside a nested method config and in a settings block such as the served chain."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from draftlab.configs import prepare_config, refuse_retired_overrides
from draftlab.utils.errors import ConfigError
from tests.test_configs import _compose

RETIRED = [
    ("method.drafter.total_tokens=8", "method.drafter.total_tokens", "nodes"),
    ("method.drafter.top_k=4", "method.drafter.top_k", "branching"),
    ("+method@eval.baselines.n2=eagle3 eval.baselines.n2.drafter.total_tokens=2", "eval.baselines.n2.drafter.total_tokens",
     "nodes"),
    ("method=draft_opd method.module.rollout_drafter.total_tokens=6", "method.module.rollout_drafter.total_tokens",
     "nodes"),
    ("eval.top_k_sampling=5", "eval.top_k_sampling", "eval.top_k"),
    ("init_draft=/drafts/d", "init_draft", "init.from"),
]


@pytest.mark.parametrize(("overrides", "field", "new"), RETIRED)
def test_a_retired_override_is_refused_naming_the_new_name(overrides, field, new, tmp_path):
    with pytest.raises(ConfigError, match=rf"'{field}'.*retired spelling.*{new}") as err:
        _compose(["method=eagle3", *overrides.split()], tmp_path)
    assert "\n" not in str(err.value)


def test_the_current_names_compose_and_reach_the_drafter(tmp_path):
    cfg = _compose(["method=eagle3", "method.drafter.nodes=8", "method.drafter.branching=3", "eval.top_k=5"], tmp_path)
    assert (cfg.method.drafter.nodes, cfg.method.drafter.branching, cfg.eval.top_k) == (8, 3, 5)
    assert OmegaConf.to_container(cfg.method.axes)["nodes"] == "drafter.nodes"


def test_retired_names_in_an_experiment_block_or_a_settings_block_are_refused(tmp_path):
    cfg = _compose(["method=eagle3"], tmp_path)
    OmegaConf.set_struct(cfg, False)
    block = OmegaConf.merge(cfg, {"method_overrides": {"eagle3": {"drafter": {"top_k": 2}}}})
    with pytest.raises(ConfigError, match=r"'method.drafter.top_k'.*branching"):
        prepare_config(block, overrides=[])
    chain = OmegaConf.merge(cfg, {"eval": {"served": {"chain": {"total_tokens": 3}}}})
    with pytest.raises(ConfigError, match=r"'eval.served.chain.total_tokens'.*nodes"):
        prepare_config(chain, overrides=[])


def test_flags_and_values_are_not_mistaken_for_settings():
    refuse_retired_overrides(["-m", "--cfg", "job", "hydra.job.chdir=false", "method.drafter.nodes=4",
                              "data.note=drafter.top_k"])  # a value that looks like a retired key is a value


def test_the_command_line_refuses_before_hydra_composes():
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli.train", "method.drafter.total_tokens=30"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: field 'method.drafter.total_tokens': retired spelling: a tree's size is 'nodes' "
                     "(drafter.nodes)"], proc.stderr
