"""Ranks from the launchers' environments, per-rank and per-job devices, rank-0-first waits, target placement."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.training import ranks

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "SLURM_JOB_NAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                "DRAFTLAB_RUN_TOKEN")


@pytest.fixture
def env(monkeypatch):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ranks, "_sync_dir", None)
    return monkeypatch


@pytest.mark.parametrize(("variables", "expected"), [
    ({}, (0, 0, 1)),
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, (1, 1, 2)),  # Lightning's ddp child
    ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (5, 1, 8)),  # torchrun
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_JOB_NAME": "train"}, (3, 3, 4)),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "bash"}, (0, 0, 1)),  # an interactive shell
])
def test_rank_local_rank_and_world_size_come_from_the_launcher(env, variables, expected):
    for k, v in variables.items():
        env.setenv(k, v)
    assert (ranks.rank(), ranks.local_rank(), ranks.world_size()) == expected
    assert ranks.is_main() == (expected[0] == 0)


def test_each_rank_puts_its_target_on_its_own_gpu(env):
    assert ranks.local_device("cuda") == "cuda" and ranks.local_device("cpu") == "cpu"
    env.setenv("LOCAL_RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    # An index in the config cannot be right for every rank; the CPU stays the CPU.
    assert ranks.local_device("cuda") == ranks.local_device("cuda:0") == "cuda:1"
    assert ranks.local_device("cpu") == "cpu"


def _hydra_job(monkeypatch, num: int, launcher: str = "hydra_plugins.hydra_joblib_launcher.JoblibLauncher"):
    from hydra.core.hydra_config import HydraConfig

    hc = OmegaConf.create({"launcher": {"_target_": launcher}, "job": {"num": num}, "mode": "RunMode.MULTIRUN"})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hc))


def test_parallel_local_sweep_jobs_take_their_own_gpu(env):
    env.setattr(torch.cuda, "device_count", lambda: 2)
    assert ranks.job_gpu() is None  # not in a Hydra job
    _hydra_job(env, 3)
    assert ranks.job_gpu() == 1 and ranks.local_device("cuda") == "cuda:1"
    assert ranks.local_device("cuda:0") == "cuda:0" and ranks.local_device("cpu") == "cpu"  # explicit: kept
    _hydra_job(env, 3, launcher="hydra._internal.core_plugins.basic_launcher.BasicLauncher")
    assert ranks.job_gpu() is None  # sequential jobs share every GPU
    env.setattr(torch.cuda, "device_count", lambda: 1)
    _hydra_job(env, 3)
    assert ranks.job_gpu() is None


def test_other_ranks_wait_for_rank_0_then_run(env, tmp_path):
    env.setenv("WORLD_SIZE", "2")
    env.setenv("LOCAL_RANK", "0")
    sync = ranks.begin_job(tmp_path, job_num=2)
    token = ranks.os.environ["DRAFTLAB_RUN_TOKEN"]  # what rank 1 inherits
    order = []

    def rank1():
        # Rank 1's view of the same launch (rank() reads the environment; here a thread stands in for it).
        with ranks.main_first("data"):
            order.append("rank 1")

    env.setattr(ranks, "is_main", lambda: threading.current_thread() is threading.main_thread())
    waiter = threading.Thread(target=rank1)
    waiter.start()
    time.sleep(0.5)
    assert order == [] and waiter.is_alive()  # rank 1 waits while rank 0 has not finished
    with ranks.main_first("data"):
        order.append("rank 0")
    waiter.join(5)
    assert order == ["rank 0", "rank 1"] and sync.name == f"{token}-2"


def test_a_failure_on_rank_0_stops_the_other_ranks(env, tmp_path):
    env.setenv("WORLD_SIZE", "2")
    ranks.begin_job(tmp_path)
    with pytest.raises(ValueError), ranks.main_first("features"):
        raise ValueError("rank 0 breaks")
    env.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="rank 0 failed in 'features'"), ranks.main_first("features"):
        pass


def test_a_rank_without_its_launch_name_refuses(env, tmp_path):
    env.setenv("WORLD_SIZE", "2")
    env.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="DRAFTLAB_RUN_TOKEN"):
        ranks.begin_job(tmp_path)
    env.setenv("SLURM_NTASKS", "2")
    env.setenv("SLURM_JOB_ID", "77")
    assert ranks.begin_job(tmp_path).name == "slurm-77-0-0-0"  # computed alike on every task


def test_a_single_process_job_leaves_no_marker_directory(env, tmp_path):
    sync = ranks.begin_job(tmp_path)
    with ranks.main_first("data"):
        pass
    assert (sync / "data.done").exists()
    ranks.end_job()
    assert not sync.exists()


def test_target_identity_keeps_the_device_type_only(tmp_path):
    # Rank 1's cuda:1 must find rank 0's (cuda:0) regeneration and features; CPU numbers differ from GPU ones.
    from draftlab.stages.data import target_identity

    def ident(device):
        return target_identity(OmegaConf.create({"target": {"source": "tiny_random", "device": device,
                                                            "aux_layer_ids": [0, 1]}}))

    assert ident("cuda:1") == ident("cuda:0") == ident("cuda") != ident("cpu")
    assert ident("cpu") == {"source": "tiny_random", "device": "cpu"}


class _Target:
    def __init__(self, device):
        self.device = torch.device(device)
        self.moves = []

    def to(self, device):
        self.moves.append(torch.device(device))
        self.device = torch.device(device)
        return self


def _setup(target, root_device):
    from draftlab.training.placement import TargetPlacement

    module = SimpleNamespace(target=target)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(root_device)))
    TargetPlacement().setup(trainer, module, "fit")
    return module


def test_placement_moves_the_target_to_the_training_device():
    target = _Target("cpu")
    assert _setup(target, "meta").target is target and target.moves == [torch.device("meta")]
    _setup(target, "meta")
    assert len(target.moves) == 1  # already there
    assert _setup(None, "meta").target is None  # a module without a target


def test_placement_refuses_a_target_that_cannot_move():
    target = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="set target.device=meta"):
        _setup(target, "meta")


def test_placement_moves_a_real_target():
    from draftlab.targets import load_target

    target = load_target("tiny_random")
    _setup(target, "meta")
    assert target.device == torch.device("meta")
