"""Every shipped config composes and instantiates (with the tiny target standing in for real models)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from draftlab.configs import prepare_config

CONF = Path(__file__).resolve().parents[1] / "conf"
PRIMARY = "train"
PRIMARIES = ("train", "eval", "data_stage", "export")


def _options():
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        if len(rel.parts) < 2 or rel.parts[0] in {"hydra", "paths", "tuning"}:  # tuning: test_experiment_methods
            continue
        group = "/".join(rel.parts[:-1])
        yield group, path.stem


def _compose(overrides, tmp_path, config_name: str = PRIMARY) -> DictConfig:
    GlobalHydra.instance().clear()
    overrides = [*overrides, f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # the job's own config, as the entry points see it
    return prepare_config(cfg)  # as every entry point does first


@pytest.mark.parametrize("primary", PRIMARIES)
def test_primary_configs_compose(primary, tmp_path):
    cfg = _compose(["checkpoint=x.ckpt"] if primary == "export" else [], tmp_path, primary)
    OmegaConf.resolve(cfg)
    assert cfg.task_name


def test_local_parallel_launcher_composes():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=PRIMARY, overrides=["hydra/launcher=local_parallel", "experiment=eval_sweep"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == 2
    assert dict(cfg.hydra.sweeper.params) == {"method.drafter.nodes": "4,8", "eval.temperature": "0,0.7"}


def test_every_config_file_is_covered():
    groups = {g.split("/")[0] for g, _ in _options()}
    assert {"target", "data", "bench", "method", "trainer", "logger", "callbacks", "experiment", "debug"} <= groups


@pytest.mark.parametrize(("group", "name"), list(_options()))
def test_compose_and_instantiate(group, name, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    override = f"{group}={name}"
    extra = []
    if group == "data" and name in {"jsonl", "hf"}:  # these name their file on the command line
        f = tmp_path / "convs.jsonl"
        f.write_text('{"id": "a", "conversations": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "hello"}]}\n')
        extra = [f"data.sources.{name}.path={f}"]
    cfg = _compose([override, *extra], tmp_path)
    if OmegaConf.is_missing(cfg.init, "from"):  # experiments that start from a trained draft must name it
        with pytest.raises(MissingMandatoryValue, match="init.from"):
            OmegaConf.resolve(cfg)
        cfg = _compose([override, *extra, "init.from=/drafts/eagle3"], tmp_path)
        assert "/drafts/eagle3" in str(OmegaConf.to_container(cfg.method, resolve=True))
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if group == "target":
        with open_dict(cfg):  # hub targets are not reachable here: the tiny target stands in for all
            cfg.target.source, cfg.target.dtype, cfg.target.device = "tiny_random", "float32", "cpu"
        t = instantiate(cfg.target)
        assert t.geometry.num_layers == 2
    elif group == "data" or (group in {"experiment", "debug"}):
        spec = instantiate(cfg.data, _convert_="object")
        assert spec.sources and spec.max_length > 0
        if group == "data":
            convs, report = spec.load()
            assert convs and report.kept == len(convs)
        else:
            # What an experiment sets lands in blocks the stages instantiate: a knob indented into the wrong
            # block (a drafter setting under trainer) fails here rather than minutes into a run.
            trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, devices=1,
                                  accelerator="cpu", strategy="auto")
            assert trainer is not None
            from draftlab.methods.registry import MethodSpec
            from draftlab.stages.evaluate import baseline_specs

            spec_m = MethodSpec(cfg.method)
            spec_m.axes()
            if spec_m.trainable:
                assert callable(instantiate(spec_m.block("drafter"))) and callable(instantiate(spec_m.block("module")))
            for bspec in baseline_specs(cfg, spec_m, has_draft=spec_m.trainable).values():
                bspec.axes()
                if bspec.trainable:  # drafts from the run's draft: its factory must compose
                    assert callable(instantiate(bspec.block("drafter")))
                else:
                    bspec.build_drafter()
    elif group == "bench":
        bench = instantiate(cfg.bench, _convert_="object")
        if name == "speedbench" and not Path(cfg.bench.path).is_dir():  # no copy ships: the how-to error instead
            from draftlab.data.errors import DataError

            with pytest.raises(DataError, match="huggingface-cli download nvidia/SPEED-Bench"):
                bench.load()
        else:
            assert bench.load()
    elif group == "trainer":
        trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False,
                              **({"devices": 1, "accelerator": "cpu", "strategy": "auto"}
                                 if name in {"ddp", "ddp_spawn", "fsdp", "gpu"} else {}))
        assert trainer is not None
    elif group == "method":
        from draftlab.decoding.drafter import Drafter
        from draftlab.methods.registry import MethodSpec

        spec = MethodSpec(cfg.method)
        spec.axes()  # every declared axis points at a real setting
        if spec.trainable:  # partials waiting for the run-time arguments (draft, target, samples, ...)
            for block in ("draft", "module", "data", "drafter"):  # a base's blocks where the method has none
                assert callable(instantiate(spec.block(block))), block
            artifact = spec.block("artifact")
            assert callable(instantiate(artifact.save)) and callable(instantiate(artifact.load))
            assert all(callable(f) for f in spec.exporters.values())
        else:
            assert isinstance(spec.build_drafter(), Drafter)
    elif group in {"logger", "callbacks"}:
        objs = {k: instantiate(v) for k, v in cfg[group].items()}
        assert all(o is not None for o in objs.values())


def test_axes_on_training_settings_come_from_the_trained_draft(tmp_path):
    # A block-4 DFlash draft evaluated under a block-8 config drafts blocks of 4: the record must say 4.
    from draftlab.methods.registry import MethodSpec, trained_method_config

    dflash = MethodSpec.from_name("dflash", ["method.draft.block_size=8"])
    assert dflash.axes()["block_size"] == 8
    plain = {"name": "dflash", "draft": {"block_size": 4, "num_layers": 1}}
    assert dflash.axes(plain)["block_size"] == 4 and dflash.axes(plain)["draft_layers"] == 1
    assert dflash.axes(plain)["tree"] == dflash.axes()["tree"]  # decoding settings stay the config's
    # Trained by a wrapper (Draft-OPD): the draft's settings are its base's, the wrapper's its own.
    wrapped = {"name": "draft_opd", "base": plain, "module": {"refresh_every": 3}}
    assert dflash.axes(wrapped)["block_size"] == 4
    opd = MethodSpec.from_name("draft_opd", ["method@method.base=dflash"])
    axes = opd.axes(wrapped)
    assert axes["block_size"] == 4 and axes["refresh_every"] == 3 and axes["base"] == "dflash"
    assert opd.axes(plain)["refresh_every"] == opd.axes()["refresh_every"]  # not trained by a wrapper
    # A setting the artifact's config lacks (an older artifact) keeps the config's value.
    assert dflash.axes({"name": "dflash"})["block_size"] == 8
    # The artifact's config sits beside its draft/ directory; a draft from elsewhere has none.
    assert trained_method_config(tmp_path / "draft") is None
    (tmp_path / "train_config.json").write_text('{"method": {"name": "dflash"}}')
    assert trained_method_config(tmp_path / "draft") == {"name": "dflash"}
    (tmp_path / "train_config.json").write_text('{"seed": 0}')
    with pytest.raises(ValueError, match="train_config.json.*'method'"):
        trained_method_config(tmp_path / "draft")


@pytest.mark.parametrize(("name", "start_method"), [("ddp", "popen"), ("ddp_spawn", "spawn")])
def test_ddp_trainers_do_not_broadcast_buffers(name, start_method, tmp_path):
    # The modules' constant buffers (the target's LM head) would be broadcast from rank 0 before every step.
    cfg = _compose([f"trainer={name}", "trainer.accelerator=cpu"], tmp_path)
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    from lightning.pytorch.strategies import DDPStrategy

    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy._ddp_kwargs == {"broadcast_buffers": False}
    assert trainer.strategy._start_method == start_method


def _slurm_launcher(cfg: DictConfig) -> DictConfig:
    """conf/hydra/launcher/slurm.yaml resolved against ``cfg`` without the submitit plugin (its own defaults)."""
    node = OmegaConf.load(CONF / "hydra" / "launcher" / "slurm.yaml")
    del node["defaults"]
    OmegaConf.set_struct(cfg, False)
    merged = OmegaConf.merge(cfg, {"slurm_launcher": node})
    OmegaConf.resolve(merged)
    return merged.slurm_launcher


@pytest.mark.parametrize(("overrides", "devices", "nodes"), [(["trainer=ddp", "trainer.devices=4"], 4, 1),
                                                           (["trainer=ddp", "trainer.num_nodes=2"], 2, 2),
                                                           ([], 1, 1)])
def test_slurm_launcher_starts_one_task_per_trainer_device(overrides, devices, nodes, tmp_path):
    # Lightning refuses a SLURM job whose tasks per node differ from trainer.devices.
    launcher = _slurm_launcher(_compose(overrides, tmp_path))
    assert launcher.tasks_per_node == launcher.gpus_per_node == devices and launcher.nodes == nodes


def test_slurm_launcher_composes_with_the_plugin(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher not installed "
                        "(the [launchers] extra)")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=PRIMARY, overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4",
                                                      f"paths.output_dir={tmp_path}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == cfg.trainer.devices == 4 and launcher.nodes == 1


@pytest.mark.parametrize("method,module", [("eagle3", "module"), ("confu", "module"), ("draft_opd", "base.module")])
def test_the_ttt_attention_kernel_stays_out_of_the_training_key(method, module, tmp_path):
    """``module.attention`` / ``cross_entropy`` pick kernels for the same loss: a draft trained with one is reused
    under another."""
    from draftlab.methods.registry import MethodSpec
    from draftlab.utils.hashing import content_key

    keys = {content_key(MethodSpec(_compose([f"method={method}", f"method.{module}.{knob}={impl}"],
                                            tmp_path).method).key_config())
            for knob in ("attention", "cross_entropy") for impl in ("auto", "torch", "triton")}
    assert len(keys) == 1
    other = _compose([f"method={method}", f"method.{module}.step_weight=0.5"], tmp_path)
    assert content_key(MethodSpec(other.method).key_config()) not in keys  # the key still sees the module
