"""``draftlab-eval`` / ``draftlab-train`` stages in-process on the tiny target, through the real configs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from draftlab.eval.answers import load_answers
from tests.test_configs import _compose

BASE = ["experiment=tiny", "logger=csv", "bench.limit=2", "eval.max_new_tokens=12"]


def _spec(cfg):
    from draftlab.methods.registry import MethodSpec

    return MethodSpec(cfg.method)


def _cfg(tmp_path, *overrides, experiment: str = "tiny"):
    # experiment=tiny carries EAGLE-3-family knobs; training-free methods compose tiny_base.
    base = [f"experiment={experiment}", *BASE[1:]]
    return _compose([*base, f"paths.artifacts={tmp_path / 'artifacts'}", *overrides], tmp_path, "eval")


def _env(monkeypatch, tmp_path, shared_data):
    # Artifacts go to the test's directory; assets (the tokenizer) stay in the shared cache.
    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))


def test_eval_training_free_method_writes_answers_and_record(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    record = run_pipeline(_cfg(tmp_path, "method=prompt_lookup", experiment="tiny_base"), stage="eval")
    assert record["kind"] == "eval" and record["train"] is None and record["artifacts"]["draft"] is None
    assert record["eval"]["mismatches_vs_ar"] == 0 and record["eval"]["label"] == "PLD"
    # The record names the method's own axes and config; a training-free drafter has no tree budget.
    assert record["eval"]["axes"] == {"nodes": 8, "branches": 1}
    assert record["eval"]["method_config"]["drafter"]["nodes"] == 8
    saved = json.loads((tmp_path / "record.json").read_text())
    assert saved["metrics"] == record["metrics"]
    method = load_answers(tmp_path / "answers" / "prompt_lookup.jsonl")
    base = load_answers(tmp_path / "answers" / "ar.jsonl")
    assert len(method) == len(base) == 2
    assert all(a["choices"][0]["accept_lengths"] == [1] * (sum(a["choices"][0]["new_tokens"]) - 1) for a in base)
    assert "AVG" in (tmp_path / "eval_table.txt").read_text() and "tau 95% CI" in (tmp_path / "eval_table.txt").read_text()
    # Per question, what intervals and paired comparisons are computed from; AVG's interval holds its point.
    rows = record["eval"]["questions"]
    assert sorted(r["question_id"] for r in rows) == sorted(a["question_id"] for a in method)
    assert sum(r["accepted"] for r in rows) == sum(sum(a["choices"][0]["accept_lengths"]) for a in method)
    # Two questions are too few for an interval: none is claimed (the table prints "-", no W&B bound).
    assert record["eval"]["interval"]["min_questions"] > 2 and record["eval"]["columns"]["AVG"]["tau_ci"] is None
    assert not any(k.endswith("_ci_lo") for k in record["metrics"])
    # MT-bench scores nothing against references, and times over wall clock by default.
    assert "scores" not in record["eval"] and record["eval"]["timing"] == "wall"


def test_eval_long_context_scores_the_needle_for_every_run(tmp_path, monkeypatch, shared_data):
    # Two NIAH-style rows whose 7-digit needle the random model will not write (found 0 for every run) and
    # one L-Eval-style row, which is timed but not scored. Decode-only timing, as for real long prompts.
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    rows = [{"id": f"niah-{i}", "question_id": 1, "category": "niah_16k", "reference": "8264917",
             "turns": [f"The special magic number is 8264917. Filler text {i}. What is the magic number?"]}
            for i in range(2)]
    rows.append({"id": "leval-0", "question_id": 1, "category": "news_summ", "reference": "a summary",
                 "turns": ["Summarise this news article: the council met on Tuesday."]})
    data = tmp_path / "lc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, "method=prompt_lookup", "bench=long_context", f"bench.sources=[{{path:'{data}',fit:drop}}]",
               "bench.limit=null", "bench.max_prompt_tokens=512", "eval.timing=decode",
               "+method@eval.baselines.sfx=suffix", experiment="tiny_base")
    record = run_pipeline(cfg, stage="eval")
    ev = record["eval"]
    assert ev["timing"] == "decode" and ev["mismatches_vs_ar"] == 0
    assert set(ev["scores"]) == {"ar", "prompt_lookup", "sfx"}
    for s in ev["scores"].values():
        assert s["n"] == 2 and s["found"] == 0 and s["by_question"] == {"niah-0": False, "niah-1": False}
    assert ev["scores"]["ar"] == ev["scores"]["prompt_lookup"]  # lossless at T=0: the same answers
    assert record["metrics"]["eval/long_context/found/ar"] == 0.0
    assert record["metrics"]["eval/long_context/found/sfx"] == 0.0
    # No ConFu column for these categories: each is reported by name, and AVG covers all three questions.
    assert ev["columns"] == {"AVG": ev["columns"]["AVG"]} and ev["columns"]["AVG"]["n_questions"] == 3
    assert set(ev["categories"]) == {"niah_16k", "news_summ"}
    assert "eval/long_context/news_summ/speedup" in record["metrics"]
    table = (tmp_path / "eval_table.txt").read_text()
    assert "niah_16k" in table and "timing=decode" in table
    answers = load_answers(tmp_path / "answers" / "ar.jsonl")
    assert all(0 < a["choices"][0]["prefill_time"][0] <= a["choices"][0]["wall_time"][0] for a in answers)


def test_an_unknown_eval_timing_fails_before_anything_runs(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline
    from draftlab.utils.errors import ConfigError

    _env(monkeypatch, tmp_path, shared_data)
    with pytest.raises(ConfigError, match="eval.timing"):
        run_pipeline(_cfg(tmp_path, "method=prompt_lookup", "eval.timing=cpu", experiment="tiny_base"), stage="eval")


def test_eval_baselines_answer_the_same_questions_beside_the_method(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    cfg = _cfg(tmp_path, "method=prompt_lookup", "+method@eval.baselines.sfx=suffix",
               "+method@eval.baselines.pld3=prompt_lookup", "eval.baselines.pld3.drafter.nodes=3",
               experiment="tiny_base")
    record = run_pipeline(cfg, stage="eval")
    baselines = record["eval"]["baselines"]
    assert set(baselines) == {"sfx", "pld3"} and baselines["sfx"]["label"] == "Suffix"
    assert all(b["mismatches_vs_ar"] == 0 for b in baselines.values())
    # Scored against the one AR run: the AR throughput of every column is the method's.
    for b in baselines.values():
        assert b["columns"]["AVG"]["ar_tps"] == record["eval"]["columns"]["AVG"]["ar_tps"]
    assert len(load_answers(tmp_path / "answers" / "sfx.jsonl")) == 2
    draft3 = load_answers(tmp_path / "answers" / "pld3.jsonl")
    assert max(max(a["choices"][0]["accept_lengths"]) for a in draft3) <= 4  # its own setting, 3 tokens + bonus
    assert any(k.startswith("baselines/sfx/") and k.endswith("/AVG/speedup") for k in record["metrics"])
    text = (tmp_path / "eval_comparison.txt").read_text()
    assert "PLD" in text and "Suffix" in text and "best baseline" in text


def test_a_training_free_run_cannot_have_a_trained_baseline(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    cfg = _cfg(tmp_path, "method=prompt_lookup", "+method@eval.baselines.e3=eagle3", experiment="tiny_base")
    with pytest.raises(ValueError, match="eval.baselines.e3.*has none.*trainable: false"):
        run_pipeline(cfg, stage="eval")


def test_a_trained_baseline_drafts_from_the_runs_draft(tmp_path, monkeypatch, shared_data, tiny_target):
    # The hybrid (EAGLE-3 tree + suffix candidates) reads the EAGLE-3 artifact: it answers beside EAGLE-3
    # from the same draft weights, losslessly, in the same process.
    from draftlab.methods.eagle3 import Eagle3Draft
    from draftlab.methods.eagle3.export.native import save_native
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    torch.manual_seed(0)
    draft_dir = save_native(Eagle3Draft.from_target(tiny_target, draft_vocab_size=512), tmp_path / "art" / "draft")
    # The artifact's training config (as draftlab-train writes it beside draft/): trained with TTT-3.
    (tmp_path / "art" / "train_config.json").write_text(json.dumps({"method": {"name": "eagle3",
                                                                                "module": {"ttt_length": 3}}}))
    record = run_pipeline(_cfg(tmp_path, "method=eagle3", f"draft_path={draft_dir}",
                               "+method@eval.baselines.hybrid=eagle3_suffix", "+method@eval.baselines.n2=eagle3",
                               "eval.baselines.n2.drafter.nodes=2"), stage="eval")
    hybrid, n2 = record["eval"]["baselines"]["hybrid"], record["eval"]["baselines"]["n2"]
    assert hybrid["label"] == "EAGLE-3 + suffix" and hybrid["mismatches_vs_ar"] == 0 == n2["mismatches_vs_ar"]
    assert len(load_answers(tmp_path / "answers" / "hybrid.jsonl")) == 2
    # The same method at another tree size: its own axes in the record, its own row in the comparison.
    assert n2["axes"]["nodes"] == 2 and record["eval"]["axes"]["nodes"] != 2 and n2["categories"]
    # A training setting is the draft's, for the method and every baseline drafting from it (the config says 7).
    assert record["eval"]["axes"]["ttt_length"] == hybrid["axes"]["ttt_length"] == n2["axes"]["ttt_length"] == 3
    text = (tmp_path / "eval_comparison.txt").read_text()
    assert "EAGLE-3 [eagle3]" in text and "EAGLE-3 [n2]" in text
    # A trained method with another artifact format cannot read this draft: refused before any decoding.
    cfg = _cfg(tmp_path, "method=eagle3", f"draft_path={draft_dir}", "+method@eval.baselines.cf=confu")
    with pytest.raises(ValueError, match="eval.baselines.cf.*'confu'.*artifact"):
        run_pipeline(cfg, stage="eval")


def test_record_names_the_commit_the_job_started_on(tmp_path, monkeypatch, shared_data):
    # A commit made while a long job runs must not be credited with its results.
    from draftlab import tracking
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    heads = iter([{"commit": "at-start", "dirty": False}, {"commit": "later", "dirty": False}])
    monkeypatch.setattr(tracking, "git_info", lambda repo=None: next(heads))
    record = run_pipeline(_cfg(tmp_path, "method=prompt_lookup", experiment="tiny_base"), stage="eval")
    assert record["git"]["commit"] == "at-start"


def test_eval_of_a_trained_method_needs_a_draft(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    with pytest.raises(ValueError, match="draft_path"):
        run_pipeline(_cfg(tmp_path, "method=eagle3"), stage="eval")


def test_eval_loads_an_exported_draft(tmp_path, monkeypatch, shared_data, tiny_target):
    from draftlab.methods.eagle3 import Eagle3Draft
    from draftlab.methods.eagle3.export.native import save_native
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    torch.manual_seed(0)
    draft_dir = save_native(Eagle3Draft.from_target(tiny_target, draft_vocab_size=512), tmp_path / "draft")
    record = run_pipeline(_cfg(tmp_path, "method=eagle3", f"draft_path={draft_dir}"),
                          stage="eval")
    assert record["artifacts"]["draft"] == str(draft_dir)
    assert record["eval"]["mismatches_vs_ar"] == 0


def test_init_head_from_target_copies_the_draft_vocabulary_rows(tiny_target):
    from draftlab.data.vocab import build_vocab_mapping
    from draftlab.methods.eagle3 import Eagle3Draft
    from draftlab.methods.eagle3.build import init_head_from_target

    freq = torch.zeros(tiny_target.geometry.vocab_size, dtype=torch.long)
    freq[torch.randperm(freq.numel())[:300]] = 5
    draft = Eagle3Draft.from_target(tiny_target, vocab_mapping=build_vocab_mapping(freq, 256))
    init_head_from_target(draft, tiny_target)
    head = tiny_target.model.get_output_embeddings().weight
    ids = draft.target_ids()
    assert not torch.equal(ids, torch.arange(256))  # a real mapping, not the identity
    assert torch.equal(draft.lm_head.weight, head[ids])


def test_train_confu_end_to_end_then_reuse(tmp_path, monkeypatch, shared_data):
    """ConFu through draftlab-train: data -> training (target in the loop) -> own artifact -> lossless eval."""
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    overrides = ["method=confu", "method.draft.num_soft_prompts=4", "method.module.num_anchors=4",
                 "trainer.max_epochs=1"]
    cfg = _compose([*BASE, f"paths.artifacts={tmp_path / 'artifacts'}", *overrides], tmp_path, "train")
    record = run_pipeline(cfg, stage="train")
    assert record["train"]["reused"] is False and record["eval"]["mismatches_vs_ar"] == 0
    assert record["eval"]["label"] == "ConFu"
    again = run_pipeline(_compose([*BASE, f"paths.artifacts={tmp_path / 'artifacts'}", *overrides], tmp_path, "train"),
                         stage="train")
    assert again["train"]["reused"] is True and again["artifacts"]["draft"] == record["artifacts"]["draft"]


def test_train_specbound_end_to_end_then_reuse(tmp_path, monkeypatch, shared_data):
    """SpecBound through draftlab-train: online target forwards, its own artifact files (no ``config.json``),
    the calibration metrics in the history, a lossless eval with drafter stats, then reuse by key."""
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    overrides = ["method=specbound", "method.module.tau=0.0", "method.data.val_fraction=0.25", "trainer.max_epochs=1"]
    base = ["experiment=tiny_base", *BASE[1:], f"paths.artifacts={tmp_path / 'artifacts'}", *overrides]
    record = run_pipeline(_compose(base, tmp_path, "train"), stage="train")
    assert record["train"]["reused"] is False and record["eval"]["mismatches_vs_ar"] == 0
    assert any("val/exit_precision_l1" in h for h in record["train"]["history"])
    answers = [json.loads(line) for line in Path(record["eval"]["answer_files"]["specbound"]).read_text().splitlines()]
    assert all(a["choices"][0]["drafter_stats"][0]["drafted"] > 0 for a in answers)  # tau 0: every round drafts
    again = run_pipeline(_compose(base, tmp_path, "train"), stage="train")
    assert again["train"]["reused"] is True and again["artifacts"]["draft"] == record["artifacts"]["draft"]


def test_continue_training_from_an_existing_draft(tmp_path, tiny_target):
    """``method.draft.init.from`` starts from a saved draft (weights and vocabulary); it enters the training key."""
    from draftlab.methods.eagle3 import Eagle3Draft
    from draftlab.methods.eagle3.export.native import save_native
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.train import train_key

    def _build_draft(cfg, target, vocab):
        return MethodSpec(cfg.method).build_draft(target, vocab)

    torch.manual_seed(0)
    start = Eagle3Draft.from_target(tiny_target, draft_vocab_size=512)
    draft_dir = save_native(start, tmp_path / "draft")
    cfg = _cfg(tmp_path, "method=eagle3", f"method.draft.init.from={draft_dir}")
    built = _build_draft(cfg, tiny_target, vocab=None)
    assert torch.equal(built.fc.weight, start.fc.weight) and torch.equal(built.d2t, start.d2t)
    plain = _cfg(tmp_path, "method=eagle3")
    assert train_key(cfg, "data", _spec(cfg)) != train_key(plain, "data", _spec(plain))
    # The default init leaves keys of earlier runs unchanged.
    unset = _cfg(tmp_path, "method=eagle3", "method.draft.init.from=null")
    assert train_key(unset, "data", _spec(unset)) == train_key(plain, "data", _spec(plain))
    with pytest.raises(ValueError, match="disagrees"):
        _build_draft(_cfg(tmp_path, "method=eagle3", f"method.draft.init.from={draft_dir}", "method.draft.num_layers=2"),
                     tiny_target, vocab=None)


def test_history_rows_hold_each_epochs_own_validation(tmp_path):
    """The val row written after epoch e carries epoch e's metrics (not e-1's) and the step it ended on."""
    import lightning as L

    from draftlab.stages.train import HistoryCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - 1).pow(2).sum()

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self):
            self.log("val/epoch_seen", float(self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # Batches as the shared data modules yield them: the history counts their non-padding tokens.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    data = torch.utils.data.DataLoader([{"attention_mask": m} for m in mask], batch_size=1)
    history = HistoryCallback(every=100)
    trainer = L.Trainer(max_epochs=3, callbacks=[history], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), train_dataloaders=data, val_dataloaders=data)
    val = [r for r in history.rows if "val/epoch_seen" in r]
    assert [(r["epoch"], r["step"], r["val/epoch_seen"]) for r in val] == [(0, 3, 0.0), (1, 6, 1.0), (2, 9, 2.0)]
    assert [r["tokens"] for r in val] == [6, 12, 18]
    seconds = [r["seconds"] for r in val]  # training wall-clock: increasing, from 0
    assert 0 <= seconds[0] <= seconds[1] <= seconds[2]
    resumed = HistoryCallback(every=100)
    resumed.load_state_dict(history.state_dict())
    assert resumed.tokens == 18 and resumed.rows == history.rows
    assert resumed.seconds() >= seconds[-1]  # a resumed run's clock goes on from the killed run's


def test_tapped_layers_are_a_method_setting_outside_the_regeneration_key(tmp_path, monkeypatch, shared_data):
    """Changing the layers a method taps changes the training key but reuses the regenerated data."""
    from draftlab.stages.data import run_data_stage
    from draftlab.stages.train import train_key

    _env(monkeypatch, tmp_path, shared_data)
    cfg = _cfg(tmp_path, "method=eagle3")
    first = run_data_stage(cfg, _spec(cfg))
    moved = _cfg(tmp_path, "method=eagle3", "method.taps=[0,1,1]", "target.layer_convention=output_of")
    calls = []
    import draftlab.stages.data as data_stage

    real = data_stage.regenerate
    monkeypatch.setattr(data_stage, "regenerate", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    second = run_data_stage(moved, _spec(moved))
    assert second.data_key == first.data_key and second.regen_path == first.regen_path
    # Nothing regenerated: every conversation was already done.
    assert calls and calls[0].new_tokens == 0 and calls[0].resumed_done == calls[0].input
    assert train_key(moved, first.data_key, _spec(moved)) != train_key(cfg, first.data_key, _spec(cfg))
    # The draft built for the moved taps reads those layers.
    from draftlab.methods.registry import MethodSpec

    draft = MethodSpec(moved.method).build_draft(first.target, first.vocab)
    assert draft.taps(first.target) == [0, 1, 1]


def test_stages_and_decoding_name_no_method():
    """The seams rule: stages/ and decoding/ never name a method or test a method class (docstrings aside)."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "src" / "draftlab"
    pattern = re.compile(r"confu|eagle|dflash|isinstance\(.*Draft", re.IGNORECASE)
    offenders = []
    for folder in ("stages", "decoding"):
        for path in sorted((root / folder).glob("*.py")):
            source = path.read_text()
            docstrings = {n.body[0].value.lineno for n in ast.walk(ast.parse(source))
                          if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            doc_lines = set()
            for n in ast.walk(ast.parse(source)):
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and n.value.lineno in docstrings:
                    doc_lines.update(range(n.value.lineno, n.value.end_lineno + 1))
            for i, line in enumerate(source.splitlines(), 1):
                code = line.split("#", 1)[0]
                if i not in doc_lines and pattern.search(code):
                    offenders.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_draft_opd_continues_a_trained_draft_and_resumes_mid_phase(tmp_path, monkeypatch, shared_data):
    """experiment=tiny trains the supervised EAGLE-3 draft; experiment=draft_opd_tiny continues it on-policy
    (rollout phases of 3 steps), evaluates it losslessly and, killed in the middle of a phase, resumes from
    its mid-phase checkpoint (rollout buffer included) to byte-identical weights."""
    from draftlab.stages.pipeline import run_pipeline
    from tests.test_interrupted_runs import _files, _Killed

    _env(monkeypatch, tmp_path, shared_data)
    art = f"paths.artifacts={tmp_path / 'artifacts'}"
    sft = run_pipeline(_compose([*BASE, art, "trainer.max_epochs=1", "eval.enabled=false"], tmp_path, "train"),
                       stage="train")
    init = sft["artifacts"]["draft"]

    def opd(*extra):
        cfg = _compose(["experiment=draft_opd_tiny", *BASE[1:], art, f"init.from={init}", "trainer.max_epochs=1",
                        *extra], tmp_path, "train")
        return run_pipeline(cfg, stage="train")

    straight = opd()
    draft = Path(straight["artifacts"]["draft"])
    assert straight["eval"]["mismatches_vs_ar"] == 0 and straight["eval"]["label"] == "Draft-OPD"
    assert straight["eval"]["axes"]["base"] == "eagle3"
    history = straight["train"]["history"]
    opd_rows = [r for r in history if "train/loss" in r]
    assert opd_rows and "val/tau" in straight["train"]["best"]
    # The draft moved away from the supervised one, and is still an EAGLE-3 draft (same artifact format).
    before, after = _files(Path(init), "*.safetensors"), _files(draft, "*.safetensors")
    assert before.keys() == after.keys() and before != after
    want = _files(draft, "*")
    shutil.rmtree(draft.parent)
    # Steps 0-2 are phase 0, the checkpoint is written after step 2 (checkpoint_every_n_steps=2 counts
    # optimiser steps: after the 2nd) -- i.e. with phase 0's buffer and one replay step still to come.
    with pytest.raises(_Killed):
        opd("+callbacks.die._target_=tests.test_interrupted_runs.DieAt", "+callbacks.die.hook=train_batch_start",
            "+callbacks.die.step=3")
    ckpt = torch.load(draft.parent / "checkpoints" / "resume.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["draft_opd"]["steps_done"] == 2 and ckpt["draft_opd"]["buffer_phase"] == 0
    assert ckpt["draft_opd"]["buffer"]  # the phase's rollouts travel with the checkpoint
    opd()
    assert _files(draft, "*") == want


def test_without_validation_the_artifact_is_the_state_training_ended_in(tmp_path, monkeypatch, shared_data,
                                                                         tiny_target):
    """No held-out split, so no "best": the saved draft is the final state, not the newest kept checkpoint (kept
    here after epoch 2 of 3, as a time-interval checkpoint falls before a max_time stop)."""
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    overrides = ["method=eagle3", "method.data.val_fraction=0", "trainer.max_epochs=3", "eval.enabled=false",
                 "callbacks.model_checkpoint.save_top_k=-1", "+callbacks.model_checkpoint.every_n_epochs=2"]
    cfg = _compose([*BASE, f"paths.artifacts={tmp_path / 'artifacts'}", *overrides], tmp_path, "train")
    record = run_pipeline(cfg, stage="train")
    root = Path(record["artifacts"]["draft"]).parent
    final = torch.load(root / "checkpoints" / "resume.ckpt", map_location="cpu", weights_only=False)
    kept = sorted((root / "checkpoints").glob("step*.ckpt"))
    assert kept and all(int(p.stem.removeprefix("step")) < final["global_step"] for p in kept)
    assert record["train"]["best"]["step"] == final["global_step"]
    draft = MethodSpec(cfg.method).load(Path(record["artifacts"]["draft"]), tiny_target)
    assert torch.equal(draft.fc.weight, final["state_dict"]["draft.fc.weight"])
    # The record names these weights and the step they were saved at.
    from draftlab.tracking import weights_sha256

    assert record["draft"]["step"] == final["global_step"] and record["draft"]["sha256"] == weights_sha256(draft)
    earlier = torch.load(kept[-1], map_location="cpu", weights_only=False)["state_dict"]["draft.fc.weight"]
    assert not torch.equal(draft.fc.weight, earlier)


@pytest.mark.gpu
def test_train_on_a_gpu_moves_a_cpu_target_there(tmp_path, monkeypatch, shared_data):
    """trainer=gpu with target.device=cpu (the tiny target's): data and features on the CPU, then the training
    module's target follows the draft to the GPU (TargetPlacement), and evaluation runs there."""
    from draftlab.stages.pipeline import run_pipeline
    from tests.conftest import TEST_TOKENIZER

    _env(monkeypatch, tmp_path, shared_data)
    # The questions and the tokenizer from local files: a GPU node may have no network for the assets.
    local = ["bench.path=${paths.shared_data}/mt_bench/question.jsonl",
             *([f"+target.tokenizer={TEST_TOKENIZER}"] if TEST_TOKENIZER else [])]
    cfg = _compose([*BASE, f"paths.artifacts={tmp_path / 'artifacts'}", "trainer=gpu", "trainer.max_epochs=1",
                    "trainer.precision=32-true", *local], tmp_path, "train")
    record = run_pipeline(cfg, stage="train")
    assert record["train"]["reused"] is False and record["train"]["history"]
    assert record["eval"]["method"] and (tmp_path / "record.json").exists()
    assert record["config"]["target"]["device"] == "cpu"


def test_gpu_training_config_trains_under_cpu_emulated_gpu_conditions(tmp_path, monkeypatch, shared_data):
    """``trainer=gpu`` as a GPU user runs it (bf16-mixed precision, an fp32 draft, Triton attention and soft
    cross-entropy), on the CPU: Lightning's bf16 autocast, Triton under its interpreter. The fp32 rotary tables
    make q / k fp32 while v is bf16; the kernels must take that mix (they crashed in the first backward)."""
    from draftlab.kernels._triton import interpreting, triton
    from draftlab.stages.pipeline import run_pipeline

    if triton is None or not interpreting():
        pytest.skip("needs triton under its interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    _env(monkeypatch, tmp_path, shared_data)
    cfg = _compose([*BASE, f"paths.artifacts={tmp_path / 'artifacts'}", "trainer=gpu", "trainer.accelerator=cpu",
                    "trainer.max_epochs=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=0",
                    "data.max_length=48",  # the interpreter runs each Triton block in numpy: short rows
                    "method.module.attention=triton", "method.module.cross_entropy=triton", "eval.enabled=false"],
                   tmp_path, "train")
    assert cfg.trainer.precision == "bf16-mixed"
    record = run_pipeline(cfg, stage="train")
    history = record["train"]["history"]
    assert history and all(math.isfinite(v) for row in history for k, v in row.items()
                           if k.startswith("train/loss") and isinstance(v, float)), history
