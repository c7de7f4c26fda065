"""Which process of a multi-process job this is, where its target goes, and how the processes wait for each other.

A ``draftlab-train`` job runs on one or several processes ("ranks"), started in one of these ways:

* one process (``trainer=default`` / ``gpu``), or ``trainer=ddp_spawn``: the job's own process runs every stage;
  Lightning spawns the training processes inside ``trainer.fit`` and they run nothing but the fit.
* ``trainer=ddp``: inside ``trainer.fit`` Lightning starts the command again for ranks 1.. (env ``LOCAL_RANK``,
  ``NODE_RANK``, ``WORLD_SIZE``, no ``RANK``); they run the job from the top, after rank 0 has done everything
  before the fit.
* SLURM (``srun``, the submitit launcher; env ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS``) or
  ``torchrun`` (``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``): every rank starts the job at the same time.

Work before the fit (regeneration, offline features) is done by rank 0 while the others wait, then load its
results (``main_first``). That wait cannot be a ``torch.distributed`` barrier: under ``trainer=ddp`` the other
ranks do not exist until rank 0 reaches the fit, and starting the process group early would pre-empt the one
Lightning sets up (its backend, port and timeout). Nor should it be one: regenerating a data set can take hours,
longer than any collective's timeout. So rank 0 leaves a marker file in a directory all ranks share
(``<artifacts>/.ranks/<launch>``: artifacts are shared by design) and the others poll for it; a failure on rank 0
leaves a failure marker instead, so the others stop rather than wait forever. After the fit the process group is
up and ``barrier`` uses it.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftlab.utils.logging import get_logger

log = get_logger(__name__)

_TOKEN_ENV = "DRAFTLAB_RUN_TOKEN"  # names one launch; set by rank 0, inherited by the ranks Lightning starts
_POLL_SECONDS = 0.2
_sync_dir: Path | None = None


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _slurm() -> bool:
    # As Lightning's SLURMEnvironment decides: tasks started by srun, unless the job is an interactive shell.
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def world_size() -> int:
    """Processes in this job: the process group's size once it is up, else what the launcher says."""
    if (dist := _dist()) is not None:
        return dist.get_world_size()
    n = _env("WORLD_SIZE")
    if n is None and _slurm():
        n = _env("SLURM_NTASKS")
    return n or 1


def local_rank() -> int:
    """This process's index on its machine (which device it trains on)."""
    value = _env("LOCAL_RANK")
    if value is None and _slurm():
        value = _env("SLURM_LOCALID")
    return value or 0


def rank() -> int:
    """This process's global rank (0 for a single process)."""
    if (dist := _dist()) is not None:
        return dist.get_rank()
    value = _env("RANK")
    if value is None and _slurm():
        value = _env("SLURM_PROCID")
    if value is None:
        # Lightning's ddp children carry no RANK; ranks 0.. of node 0 are its local ranks, and any rank on
        # another node is not the main one (its exact index is the process group's, once it is up).
        node = _env("NODE_RANK") or 0
        value = local_rank() if node == 0 else node * max(1, world_size()) + local_rank()
    return value


def is_main() -> bool:
    return rank() == 0


def local_device(device: str) -> str:
    """Where this process's target goes, for a configured ``target.device``.

    Under several ranks each one takes the device of its local rank (``cuda`` -> ``cuda:<LOCAL_RANK>``): a
    configured index cannot be right for every rank. In a parallel local sweep (the joblib launcher), job i
    takes ``cuda:<i % GPUs>`` when the config says plain ``cuda``. Anything else is kept as configured.
    """
    kind = device.split(":", 1)[0]
    if kind != "cuda":
        return device
    if world_size() > 1:
        return f"cuda:{local_rank()}"
    gpu = job_gpu() if device == "cuda" else None
    return device if gpu is None else f"cuda:{gpu}"


def job_gpu() -> int | None:
    """The GPU of this job in a parallel local sweep (joblib launcher): job number modulo GPUs; else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        launcher = str(hc.launcher.get("_target_", ""))
        num = hc.job.get("num")
        multirun = str(hc.mode) == "RunMode.MULTIRUN"
    except Exception:  # noqa: BLE001 - not inside a Hydra job (tests, notebooks)
        return None
    if not multirun or "Joblib" not in launcher or num is None:
        return None
    import torch

    n = torch.cuda.device_count()
    return int(num) % n if n > 1 else None


def begin_job(artifacts: str | Path, job_num: int | None = None) -> Path:
    """Name this launch's marker directory (the same on every rank); called once per job, before any wait."""
    global _sync_dir
    token = _launch_token()
    if token is None:
        if is_main():
            # A fresh name per job: ranks Lightning starts later inherit it through the environment.
            os.environ[_TOKEN_ENV] = token = uuid.uuid4().hex[:16]
        elif (token := os.environ.get(_TOKEN_ENV)) is None:
            raise RuntimeError(f"rank {rank()} started without {_TOKEN_ENV}: it cannot find rank 0's markers "
                               "(start multi-process jobs through Lightning, srun or torchrun)")
    _sync_dir = Path(artifacts) / ".ranks" / f"{token}-{job_num or 0}"
    return _sync_dir


def _launch_token() -> str | None:
    """A name every rank of a SLURM / torchrun launch computes alike (a requeued job gets a new one)."""
    if _slurm() and "SLURM_JOB_ID" in os.environ:
        return "slurm-" + "-".join(os.environ.get(k, "0") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID",
                                                                     "SLURM_RESTART_COUNT"))
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return "elastic-" + "-".join(os.environ.get(k, "0") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                                                       "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"))
    return None


def end_job() -> None:
    """Remove the marker directory where no rank can still be waiting on it (one process, or after a barrier)."""
    global _sync_dir
    if _sync_dir is not None and (world_size() == 1 or _dist() is not None) and is_main():
        shutil.rmtree(_sync_dir, ignore_errors=True)
    _sync_dir = None


@contextmanager
def main_first(name: str) -> Iterator[None]:
    """Rank 0 runs the body first; the other ranks wait until it has, then run it (to load what it made).

    Before ``begin_job`` (a stage called on its own) the body just runs. Rank 0 leaves its markers even when it
    is alone so far: under ``trainer=ddp`` the other ranks only start later, inside the fit.
    """
    if _sync_dir is None:
        yield
        return
    done, failed = _sync_dir / f"{name}.done", _sync_dir / f"{name}.failed"
    if not is_main():
        _wait_for(done, failed, name)
        yield
        return
    _sync_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        failed.touch()
        raise
    done.touch()


def _wait_for(done: Path, failed: Path, name: str) -> None:
    t0, said = time.monotonic(), False
    while not done.exists():
        if failed.exists():
            raise RuntimeError(f"rank 0 failed in '{name}'; rank {rank()} stops too (see rank 0's log)")
        if not said and time.monotonic() - t0 > 5:
            log.info("rank %d: waiting for rank 0 to finish '%s'", rank(), name)
            said = True
        time.sleep(_POLL_SECONDS)


def barrier() -> None:
    """Every rank waits for all the others (a no-op without a process group: then there is one process)."""
    if (dist := _dist()) is not None:
        dist.barrier()
