"""An experiment says what runs for any method: ``experiment=quickstart method=<m>`` composes the experiment's
data, budget and evaluation with the method's own knobs (plus the experiment's tuning, ``conf/tuning/<t>/<m>.yaml``), and
trains and evaluates every trainable method. Also the config forms this rests on: sources as a mapping whose
data keys equal the list form's, and one-line errors for a knob a method lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftlab.configs import compose_train_config
from draftlab.methods.registry import MethodSpec, apply_ci, method_names
from draftlab.utils.errors import ConfigError
from tests.test_configs import CONF, _compose


def _trainable() -> list[str]:
    return [n for n in method_names() if MethodSpec.from_name(n).trainable]


# The quickstart's shape on the 2-layer random target, sized to seconds: 4 original conversations (no
# regeneration), two optimiser steps, one question of 8 tokens beside the quickstart's training-free baselines.
TINY_RUN = ["target=tiny_random", "logger=csv", "regen.enabled=false", "data.sources.sharegpt.limit=4",
            "data.max_length=256", "trainer.max_epochs=1", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
            "trainer.precision=32-true", "bench.limit=1", "eval.max_new_tokens=8", "eval.warmup=0",
            "train.checkpoint_every_n_steps=0"]


@pytest.mark.parametrize("method", _trainable())
def test_quickstart_trains_and_evaluates_every_trainable_method(method, tmp_path, monkeypatch, shared_data, caplog):
    from draftlab.stages.pipeline import run_pipeline

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    cfg = _compose(["experiment=quickstart", f"method={method}", *TINY_RUN,
                    f"paths.artifacts={tmp_path / 'artifacts'}"], tmp_path)
    spec = MethodSpec(cfg.method)
    apply_ci(cfg.method)  # the method's CPU-test knobs (small trees, short rollouts), as the conformance suite's
    with caplog.at_level("INFO", logger="lightning"):
        record = run_pipeline(cfg, stage="train")
    assert not [r for r in caplog.records if "weights_only" in r.getMessage()]  # Lightning's notice, once a save
    assert record["train"]["reused"] is False and record["train"]["history"]
    assert record["eval"]["mismatches_vs_ar"] == 0 and record["eval"]["label"] == spec.label
    assert set(record["eval"]["baselines"]) == {"pld", "suffix"}
    from draftlab.training.checkpoint import unsafe_objects

    ckpts = sorted((tmp_path / "artifacts").rglob("*.ckpt"))
    assert ckpts and all(unsafe_objects(c) == [] for c in ckpts)  # every checkpoint reads as weights only


def test_an_experiment_sets_only_the_selected_methods_knobs(tmp_path):
    eagle3 = _compose(["experiment=quickstart", "method=eagle3"], tmp_path).method
    assert eagle3.module.ttt_length == 2 and eagle3.draft_vocab_size == 4096 and eagle3.drafter.nodes == 6
    dflash = _compose(["experiment=quickstart", "method=dflash"], tmp_path).method
    assert "ttt_length" not in dflash.module and dflash.draft_vocab_size is None  # its own file's knobs ...
    assert dflash.data.val_fraction == 0.1  # ... and the quickstart's block for it
    # The command line (and a sweep's values) wins over the experiment's block.
    swept = _compose(["experiment=quickstart", "method=eagle3", "method.module.ttt_length=5"], tmp_path).method
    assert swept.module.ttt_length == 5 and swept.drafter.nodes == 6


def _conf_with(tmp_path, files: dict[str, str]) -> Path:
    """A copy of the real conf/ with ``files`` (relative path -> text) added."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    for rel, text in files.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    return conf


def test_every_tuning_names_only_knobs_its_method_has(tmp_path):
    """Each ``conf/tuning/<t>/<m>.yaml`` composed with its method: the knob check passes and the values land."""
    tunings = sorted(CONF.glob("tuning/*/*.yaml"))
    assert len(tunings) >= 10
    for path in tunings:
        cfg = compose_train_config([f"tuning={path.parent.name}", f"method={path.stem}", "init.from=/d"])
        assert cfg.method.name == path.stem


def test_a_knob_the_method_lacks_is_one_line_naming_it_and_the_tuning_file(tmp_path, monkeypatch):
    conf = _conf_with(tmp_path, {"tuning/quickstart/dflash.yaml": "module: {ttt_length: 3}\n"})
    monkeypatch.setenv("DRAFTLAB_CONF", str(conf))
    with pytest.raises(ConfigError) as err:
        compose_train_config(["experiment=quickstart", "method=dflash"])
    msg = str(err.value)
    assert "conf/tuning/quickstart/dflash.yaml" in msg and "module.ttt_length" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="no tuning 'quickstrat'"):
        compose_train_config(["tuning=quickstrat"])


def test_the_cli_refuses_a_knob_the_method_lacks_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    conf = _conf_with(tmp_path, {"tuning/quickstart/dflash.yaml": "module: {ttt_length: 3}\n"})
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli.train", "experiment=quickstart", "method=dflash",
                           f"paths.log_dir={tmp_path}", f"paths.artifacts={tmp_path / 'a'}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "DRAFTLAB_CONF": str(conf)})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "conf/tuning/quickstart/dflash.yaml" in lines[0] and "module.ttt_length" in lines[0]


def test_sources_are_a_mapping_whose_data_key_is_the_list_forms(tmp_path, monkeypatch, shared_data):
    from hydra.utils import instantiate

    from draftlab.data.sources import ConversationSource, DataSpec
    from draftlab.utils.hashing import content_key

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    # The keys these experiments' data had when sources were a list (so their artifacts are reused).
    for experiment, key in [("smollm2_small", "e9a0912550ec86f4"), ("draft_opd_prompts", "a09dce3d9fb73b0c"),
                            ("smollm2_eagle3", "436a1c787adfcc8d")]:
        over = ["init.from=/x"] if experiment.startswith("draft_opd") else []
        spec = instantiate(_compose([f"experiment={experiment}", *over], tmp_path).data, _convert_="object")
        assert content_key(spec.fingerprint()) == key, experiment
    spec = DataSpec(sources={"a": {"path": "x.jsonl", "limit": 3}, "gone": None})
    assert list(spec.sources) == ["a"] and spec.sources["a"].name == "a" and spec.sources["a"].limit == 3
    with pytest.raises(ConfigError, match="data.sources.*mapping keyed by name"):
        DataSpec(sources=[{"path": "x.jsonl"}])
    built = DataSpec(sources=[ConversationSource(path="x.jsonl", name="a")])  # Python callers build sources
    assert list(built.sources) == ["a"]
    with pytest.raises(ConfigError, match=r"data.sources.a.*\['limt'\]"):
        DataSpec(sources={"a": {"path": "x.jsonl", "limt": 3}})


@pytest.mark.parametrize(("method", "where"), [("eagle3", "draft"), ("confu", "draft"), ("dflash", "draft"),
                                               ("draft_opd", "base.draft")])
def test_init_from_is_the_one_spelling_of_a_start_draft(method, where, tmp_path):
    cfg = _compose([f"method={method}", "init.from=/drafts/d"], tmp_path)
    assert OmegaConf.select(cfg.method, f"{where}.init.from") == "/drafts/d"
    plain = _compose([f"method={method}"], tmp_path)
    assert OmegaConf.select(plain.method, f"{where}.init.from", default=None) is None
    with pytest.raises(ConfigError, match="'init.from'.*contradicts"):
        _compose([f"method={method}", "init.from=/drafts/d", f"++method.{where}.init.from=/drafts/other"], tmp_path)
    with pytest.raises(ConfigError, match="'init.from'.*trains no draft.*prompt_lookup"):
        _compose(["method=prompt_lookup", "init.from=/drafts/d"], tmp_path)
