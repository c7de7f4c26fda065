"""A job killed with SIGKILL at random points, then re-run, ends exactly where an uninterrupted job ends.

The whole ``draftlab-train`` job on the tiny target (regeneration, vocabulary, offline features, training,
evaluation, run record) and ``draftlab-export`` run in subprocesses. The interrupted copy is killed
``KILLS`` times, each time after a random delay into its work (uniform over the uninterrupted job's
duration after the target is loaded), and then run to the end. After every kill, whatever looks finished
must be finished (``assert_nothing_half_written``); at the end every kept result must equal the
uninterrupted job's: the regenerated data, the feature store, the vocabulary, the draft's weights (byte for
byte), the answers and their acceptance lengths, and the exported directories.

The kill delays are random on purpose (a fixed set of points would only test those). A failure prints the
delays; ``DRAFTLAB_KILL_SEED`` replays the same ones (timing jitter aside).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftlab.eval.answers import load_answers

REPO = Path(__file__).resolve().parents[1]
KILLS = 3
# Printed once the target is built, i.e. after the imports: delays count from here.
WORK_STARTS = "draftlab.stages.data] target"
TRAIN = ["experiment=tiny", "logger=csv", "trainer.max_epochs=3", "bench.limit=3"]


def _env(shared_data: Path) -> dict[str, str]:
    return {**os.environ, "DRAFTLAB_SHARED_DATA": str(shared_data), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _launch(module: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    out = open(log, "ab")
    try:
        # Its own process group, so the kill reaches any worker it starts as well.
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=log.parent, env=env, start_new_session=True)
    finally:
        out.close()


def _wait_for(proc: subprocess.Popen, log: Path, marker: str, timeout: float = 120.0) -> bool:
    """Wait until ``marker`` is in ``log`` (True) or the process has exited (False)."""
    seen = log.stat().st_size if log.exists() else 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.encode() in log.read_bytes()[seen:]:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError(f"{marker!r} never appeared in {log}")


def run_to_end(module: str, args: list[str], log: Path, env: dict[str, str], marker: str) -> float:
    """Run to completion; returns the seconds from ``marker`` to the exit."""
    proc = _launch(module, args, log, env)
    _wait_for(proc, log, marker)
    t0 = time.monotonic()
    rc = proc.wait(timeout=600)
    assert rc == 0, log.read_text()[-4000:]
    return time.monotonic() - t0


def run_with_kills(module: str, args: list[str], log: Path, env: dict[str, str], marker: str, work: float,
                   rng: random.Random, check) -> list[float]:
    """Kill the job up to ``KILLS`` times at random delays after ``marker``, calling ``check`` after each kill,
    then run it to the end. Returns the delays of the kills that happened before the job finished."""
    delays: list[float] = []
    for _ in range(KILLS):
        delay = rng.uniform(0.0, work)
        proc = _launch(module, args, log, env)
        started = _wait_for(proc, log, marker)
        if started:
            time.sleep(delay)
        if proc.poll() is not None:  # finished (or failed) before the kill
            assert proc.returncode == 0, log.read_text()[-4000:]
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        delays.append(round(delay, 2))
        check()
    run_to_end(module, args, log, env, marker)
    return delays


# ---- invariants after a kill ---------------------------------------------------------------------------


def _visible(root: Path, pattern: str) -> list[Path]:
    # Hidden names are the temporaries of atomic writes: by design they never look finished.
    return sorted(p for p in root.glob(pattern) if not any(part.startswith(".") for part in p.relative_to(root).parts))


def assert_nothing_half_written(art: Path, run: Path, n_questions: int) -> None:
    for store in _visible(art, "features/*"):
        files = _visible(store, "*.safetensors")
        for f in files:
            load_file(str(f))  # every visible feature file is whole
        if (store / "complete.json").exists():
            assert len(files) == json.loads((store / "complete.json").read_text())["num_samples"], store
    for f in _visible(art, "vocab_mapping/*.pt"):
        torch.load(f, weights_only=True)
    for key_dir in _visible(art, "eagle3/*"):
        draft = key_dir / "draft"
        if draft.exists():
            assert (key_dir / "train_summary.json").exists(), "a finished draft without its summary"
            json.loads((key_dir / "train_summary.json").read_text())
            json.loads((draft / "config.json").read_text())
            load_file(str(draft / "model.safetensors"))
    for f in _visible(run, "answers/*.jsonl"):
        assert len(load_answers(f)) == n_questions, f"{f} looks finished but is not"
    if (run / "record.json").exists():
        assert json.loads((run / "record.json").read_text())["eval"]["mismatches_vs_ar"] == 0


# ---- equality of what is kept ----------------------------------------------------------------------------


def _regenerated(art: Path) -> dict[str, dict]:
    records = {}
    for f in _visible(art, "regen/*/regenerated.jsonl"):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            assert row["id"] not in records, f"{row['id']} regenerated twice"
            records[row["id"]] = row
    return records


def _answers(run: Path) -> dict[str, list]:
    out = {}
    for f in _visible(run, "answers/*.jsonl"):
        out[f.name] = sorted((a["question_id"], a["choices"][0]["turns"], a["choices"][0]["accept_lengths"])
                             for a in load_answers(f))
    return out


def _content(path: Path):
    if path.suffix == ".safetensors":
        # Compared by content: safetensors writes its metadata map in no fixed order.
        with safe_open(str(path), framework="pt") as f:
            return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in sorted(f.keys())}
    return path.read_bytes()


def _files(root: Path, pattern: str) -> dict[str, object]:
    return {str(p.relative_to(root)): _content(p) for p in _visible(root, pattern) if p.is_file()}


def assert_same_results(a: tuple[Path, Path], b: tuple[Path, Path]) -> None:
    (art_a, run_a), (art_b, run_b) = a, b
    assert _regenerated(art_a) == _regenerated(art_b), "regenerated data differ"
    assert _files(art_a, "features/*/*") == _files(art_b, "features/*/*"), "feature stores differ"
    for pa, pb in zip(_visible(art_a, "vocab_mapping/*.pt"), _visible(art_b, "vocab_mapping/*.pt"), strict=True):
        va, vb = torch.load(pa, weights_only=True), torch.load(pb, weights_only=True)
        assert torch.equal(va["d2t"], vb["d2t"]) and torch.equal(va["t2d"], vb["t2d"])
    drafts_a, drafts_b = _files(art_a, "eagle3/*/draft/*"), _files(art_b, "eagle3/*/draft/*")
    assert drafts_a and drafts_a == drafts_b, "trained drafts differ"
    answers_a = _answers(run_a)
    assert answers_a and answers_a == _answers(run_b), "answers differ"
    rec_a, rec_b = (json.loads((r / "record.json").read_text()) for r in (run_a, run_b))
    assert rec_a["eval"]["columns"]["AVG"]["tau"] == rec_b["eval"]["columns"]["AVG"]["tau"]
    assert rec_a["artifacts"]["train_key"] == rec_b["artifacts"]["train_key"]


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("DRAFTLAB_KILL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"DRAFTLAB_KILL_SEED={seed}")
    return random.Random(seed)


def _train_args(root: Path, name: str) -> list[str]:
    return [*TRAIN, f"paths.artifacts={root / name / 'art'}", f"hydra.run.dir={root / name / 'run'}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shared_data) -> tuple[Path, float]:
    """The uninterrupted train job both kill tests compare against (and export from): its directory and the
    seconds its work took."""
    root = tmp_path_factory.mktemp("straight_job")
    (root / "straight").mkdir()
    work = run_to_end("draftlab.cli.train", _train_args(root, "straight"), root / "straight" / "job.log",
                      _env(shared_data), WORK_STARTS)
    return root / "straight", work


@pytest.mark.xdist_group("interrupted-straight")  # one worker runs the straight job for both
def test_killed_train_job_reruns_to_the_uninterrupted_result(tmp_path, shared_data, rng, straight):
    env = _env(shared_data)
    n_questions = 3
    done, work = straight
    (tmp_path / "killed").mkdir()
    killed = (tmp_path / "killed" / "art", tmp_path / "killed" / "run")
    delays = run_with_kills("draftlab.cli.train", _train_args(tmp_path, "killed"), tmp_path / "killed" / "job.log",
                            env, WORK_STARTS, work, rng, lambda: assert_nothing_half_written(*killed, n_questions))
    try:
        assert_same_results((done / "art", done / "run"), killed)
    except AssertionError as e:
        raise AssertionError(f"{e} (train job killed after {delays} s of work)") from e


@pytest.mark.xdist_group("interrupted-straight")  # one worker runs the straight job for both
def test_killed_export_reruns_to_the_uninterrupted_result(tmp_path, shared_data, rng, straight):
    # From the uninterrupted train job's resume checkpoint, into two places, one of them killed.
    env = _env(shared_data)
    ckpt = next((straight[0] / "art").glob("eagle3/*/checkpoints/resume.ckpt"))
    (tmp_path / "logs").mkdir()

    def export_args(out: str) -> list[str]:
        # validate=false: the 2-layer target's default taps [0, 0, 1] are not three distinct layers, which
        # the serving formats require; what is tested here is the write, not the format.
        return ["target=tiny_random", f"checkpoint={ckpt}", f"output_dir={tmp_path / out}", "validate=false",
                f"hydra.run.dir={tmp_path / out}-run"]

    marker = "loaded lightning draft"  # logged once the draft is read, just before the formats are written
    work = run_to_end("draftlab.cli.export", export_args("export_a"), tmp_path / "logs" / "straight.log", env,
                      marker)
    want = _files(tmp_path / "export_a", "**/*")
    assert want

    def export_check():
        got = _files(tmp_path / "export_b", "**/*")
        # Whatever format directory is visible is the finished one.
        for fmt_dir in {Path(k).parts[0] for k in got}:
            assert {k: v for k, v in got.items() if k.startswith(fmt_dir + "/")} == \
                {k: v for k, v in want.items() if k.startswith(fmt_dir + "/")}, f"export {fmt_dir} is half written"

    delays = run_with_kills("draftlab.cli.export", export_args("export_b"), tmp_path / "logs" / "killed.log", env,
                            marker, work, rng, export_check)
    assert _files(tmp_path / "export_b", "**/*") == want, f"exports differ (killed after {delays} s)"


# ---- the resume points, one by one ------------------------------------------------------------------------


class _Killed(Exception):
    pass


class DieAt(L.Callback):
    """Raises at ``hook`` once ``global_step == step`` (an in-process stand-in for a kill at that point)."""

    def __init__(self, hook: str, step: int):
        self.hook, self.step = hook, step

    def _maybe(self, trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_step == self.step and not trainer.sanity_checking:
            raise _Killed(hook)

    def on_validation_start(self, trainer, pl_module):
        self._maybe(trainer, "validation_start")

    def on_train_epoch_end(self, trainer, pl_module):
        self._maybe(trainer, "train_epoch_end")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._maybe(trainer, "train_batch_start")


@pytest.mark.parametrize("hook", ["validation_start", "train_epoch_end", "train_batch_start"])
def test_resuming_at_an_epoch_boundary_keeps_the_same_best_draft(tmp_path, monkeypatch, shared_data, hook):
    """Around an epoch end (2 batches per epoch; the resume checkpoint is due at step 2, the epoch's last
    batch): killed before its validation, after it but before the epoch-end checkpoints, or just after them.
    The resume checkpoint once missed the validation (written before it) or the ModelCheckpoint's record of
    it (written before the ModelCheckpoint acted); the resumed run then chose another best draft."""
    from draftlab.stages.pipeline import run_pipeline
    from tests.test_configs import _compose

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    base = [*TRAIN, "bench.limit=1", f"paths.artifacts={tmp_path / 'art'}"]

    def run(*extra):
        return run_pipeline(_compose([*base, *extra], tmp_path / "run"), stage="train")

    straight = run()
    draft = Path(straight["artifacts"]["draft"])
    want = _files(draft, "*")
    shutil.rmtree(draft.parent)  # keep the data stage and features; train again from scratch
    with pytest.raises(_Killed):
        run(f"+callbacks.die._target_={__name__}.DieAt", f"+callbacks.die.hook={hook}", "+callbacks.die.step=2")
    assert not draft.exists()
    run()
    assert _files(draft, "*") == want
