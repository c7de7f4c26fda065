"""One name per concept (README "Glossary"): the current names compose and reach the drafter, and no config
file, script or document uses a retired spelling (the table below; a lint, since a pre-1.0 project does not keep
old names alive at run time: on the command line an undeclared name fails as Hydra's "not in struct")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.test_configs import _compose

ROOT = Path(__file__).resolve().parents[1]

# Settings renamed so that each concept has one name: (pattern of the dotted setting, what to write instead).
RETIRED: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(drafter|rollout_drafter|chain)\.total_tokens$", "a tree's size is 'nodes' (drafter.nodes)"),
    (r"(^|\.)(drafter|rollout_drafter|chain)\.top_k$", "a tree's width is 'branching'; top_k is sampling only"),
    (r"^eval\.top_k_sampling$", "sampling top-k is eval.top_k"),
    (r"^eval\.others$", "comparison drafters are eval.baselines"),
    (r"^init_draft$|(^|\.)draft\.init_from$", "start from a trained draft with init.from=DIR"),
    (r"(^|\.)(drafter|lookup|fast)\.(num_draft_tokens|max_spec_tokens)$", "a proposal's size is 'nodes' (drafter.nodes)"),
    (r"(^|\.)drafter\.width$", "SSD's candidates per outcome position are drafter.per_position"),
    (r"^eval\.max_tree_rows$", "a verify pass's reserved cache rows are eval.scratch_rows"),
    (r"^method_overrides(\.|$)", "an experiment's knobs per method are its tuning (conf/tuning/<t>/<m>.yaml)"),
)


def _yaml_paths(node, prefix: str = ""):
    """Every dotted setting path of a loaded YAML mapping (the defaults list left out)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "defaults" and not prefix:
                continue
            path = f"{prefix}{key}"
            yield path
            yield from _yaml_paths(value, path + ".")


# `key=value` on a command line (scripts, READMEs, config comments): the key, its + / ~ / ++ marks dropped.
_ASSIGNMENT = re.compile(r"(?<![\w.$/-])[+~]{0,2}([A-Za-z_][\w]*(?:\.[\w@]+)+|init_draft|method_overrides)=")


def retired_uses(paths) -> list[str]:
    """``file: setting -> new spelling`` for every retired spelling in ``paths`` (YAML keys and command lines)."""
    found = []
    for path in paths:
        text = path.read_text(errors="replace")
        keys = set(_ASSIGNMENT.findall(text))
        if path.suffix == ".yaml":
            try:
                loaded = yaml.safe_load(text)
            except yaml.YAMLError:
                loaded = None
            global_ = "@package _global_" in text or path.parent.name != "method"
            keys |= {k for k in _yaml_paths(loaded) if global_ or "." in k}
        for key in sorted(keys):
            for pattern, instead in RETIRED:
                if re.search(pattern, key.split("@", 1)[0]):
                    found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {key} -> {instead}")
    return found


def _project_files():
    for pattern in ("conf/**/*.yaml", "experiments/**/*.sh", "experiments/**/*.md", "experiments/**/*.py",
                    "*.md", "docs/**/*.md", "src/**/*.py"):
        for path in ROOT.glob(pattern):
            if "records" not in path.parts and "runs" not in path.parts:
                yield path


def test_no_config_script_or_document_uses_a_retired_spelling():
    files = list(_project_files())
    assert len(files) > 100
    assert retired_uses(files) == []


def test_the_lint_finds_a_retired_spelling_wherever_it_is_written(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("# @package _global_\neval:\n  top_k_sampling: 5\nmethod:\n  drafter: {total_tokens: 8}\n")
    tuned = tmp_path / "method" / "eagle3.yaml"
    tuned.parent.mkdir()
    tuned.write_text("drafter:\n  top_k: 4\nmodule:\n  rollout_drafter: {total_tokens: 2}\n")
    script = tmp_path / "run.sh"
    script.write_text("draftlab-train method.drafter.total_tokens=30 +init_draft=/d eval.note=drafter.top_k\n")
    found = retired_uses([exp, tuned, script])
    assert any("exp.yaml: eval.top_k_sampling" in f for f in found)
    assert any("exp.yaml: method.drafter.total_tokens" in f for f in found)
    assert any("eagle3.yaml: drafter.top_k" in f for f in found)
    assert any("eagle3.yaml: module.rollout_drafter.total_tokens" in f for f in found)
    assert any("run.sh: method.drafter.total_tokens" in f for f in found)
    assert any("run.sh: init_draft" in f for f in found)
    assert not any("eval.note" in f for f in found) and len(found) == 6  # a value that looks like a key is a value


def test_the_current_names_compose_and_reach_the_drafter(tmp_path):
    cfg = _compose(["method=eagle3", "method.drafter.nodes=8", "method.drafter.branching=3", "eval.top_k=5"], tmp_path)
    assert (cfg.method.drafter.nodes, cfg.method.drafter.branching, cfg.eval.top_k) == (8, 3, 5)
    assert OmegaConf.to_container(cfg.method.axes)["nodes"] == "drafter.nodes"


def test_the_glossary_names_are_the_settings_the_configs_declare(tmp_path):
    """Every setting the README glossary names in backticks as ``group.key`` exists in the composed configs."""
    glossary = (ROOT / "README.md").read_text().split("## Glossary", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`((?:method|drafter|eval|regen|init)\.[a-z_]+(?:\.[a-z_]+)*)`", glossary))
    assert {"drafter.nodes", "drafter.branching", "eval.top_k", "init.from", "method.taps"} <= named
    cfg = _compose(["method=eagle3", "+method@eval.baselines.pld=prompt_lookup"], tmp_path)
    for name in named:
        path = name if name.split(".")[0] in cfg else f"method.{name}"
        assert OmegaConf.select(cfg, path, default="<absent>", throw_on_missing=False) != "<absent>", name


def test_a_retired_name_on_the_command_line_fails_naming_it():
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli.train", "method.drafter.total_tokens=30"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "method.drafter.total_tokens" in proc.stderr, proc.stderr


@pytest.mark.parametrize("key", ["eval.top_k_sampling", "init_draft", "method.drafter.top_k"])
def test_a_retired_name_in_an_override_fails_to_compose(key, tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=re.escape(key.split(".")[-1])):
        _compose(["method=eagle3", f"{key}=5"], tmp_path)
