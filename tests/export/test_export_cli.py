"""Lightning checkpoints -> exports, through the Python API, the composed Hydra config and the console entry."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from export_testlib import draft_outputs, tiny_draft

from draftlab.methods.eagle3.export import (
    detect_source,
    draft_from_lightning_checkpoint,
    export_checkpoint,
    load_draft,
    load_native,
    load_speculators,
    validate_sglang,
    validate_speculators,
    validate_vllm,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def write_lightning_checkpoint(draft, path: Path, *, prefix: str = "draft.") -> Path:
    """What the EAGLE-3 training module's checkpoints hold: draft.* weights (no embedding) + the config."""
    state = {prefix + k: v.clone() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    state["loss_weights"] = torch.ones(3)  # some other module state, not part of the draft
    torch.save({"epoch": 2, "global_step": 40, "pytorch-lightning_version": "2.4.0", "state_dict": state,
                "eagle3_config": draft.config.to_dict(), "optimizer_states": [{}],
                "hyper_parameters": {"lr": 1e-4}}, path)
    return path


@pytest.fixture
def trained(tiny_target, tmp_path):
    """A draft sized like the tiny target (its embedding installed) and its Lightning checkpoint."""
    g = tiny_target.geometry
    draft = tiny_draft(vocab_size=g.vocab_size, hidden_size=g.hidden_size)
    draft.load_target_embedding(tiny_target)
    return draft, write_lightning_checkpoint(draft, tmp_path / "last.ckpt")


def assert_same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(draft_outputs(a), draft_outputs(b)))


def test_draft_from_lightning_checkpoint(trained, tiny_target, tmp_path):
    draft, ckpt = trained
    back = draft_from_lightning_checkpoint(ckpt, target=tiny_target)
    assert back.config == draft.config
    assert_same(draft, back)
    with pytest.raises(ValueError, match="target"):
        draft_from_lightning_checkpoint(ckpt)
    # torch.compile's wrapper name inside the keys is tolerated.
    compiled = write_lightning_checkpoint(draft, tmp_path / "compiled.ckpt", prefix="draft._orig_mod.")
    assert_same(draft, draft_from_lightning_checkpoint(compiled, target=tiny_target))
    assert detect_source(ckpt) == "lightning"
    assert_same(draft, load_draft(ckpt, target=tiny_target))


def test_truncated_or_corrupt_checkpoint(trained, tmp_path):
    _, ckpt = trained
    data = ckpt.read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated\.ckpt.*(truncated or corrupt)"):
        draft_from_lightning_checkpoint(truncated, require_embedding=False)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="garbage.ckpt"):
        draft_from_lightning_checkpoint(garbage, require_embedding=False)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        draft_from_lightning_checkpoint(tmp_path / "missing.ckpt")


def test_checkpoint_without_config_or_with_missing_weights(trained, tmp_path):
    draft, ckpt = trained
    blob = torch.load(ckpt, weights_only=False)
    no_cfg = tmp_path / "no_cfg.ckpt"
    torch.save({k: v for k, v in blob.items() if k != "eagle3_config"}, no_cfg)
    with pytest.raises(ValueError, match="no_cfg.ckpt.*eagle3_config"):
        draft_from_lightning_checkpoint(no_cfg, require_embedding=False)
    blob["state_dict"].pop("draft.norm.weight")
    partial = tmp_path / "partial.ckpt"
    torch.save(blob, partial)
    with pytest.raises(ValueError, match=r"partial.ckpt.*missing keys \['norm.weight'\]"):
        draft_from_lightning_checkpoint(partial, require_embedding=False)


def test_export_checkpoint_all_formats(trained, tiny_target, tmp_path):
    from draftlab.methods.eagle3.export.convert import export_formats

    assert export_formats("both") == export_formats("all") == ["sglang", "vllm", "speculators"]
    assert export_formats("native") == ["sglang"]
    draft, ckpt = trained
    written = export_checkpoint(ckpt, tmp_path / "out", format="all", max_position_embeddings=4096,
                                verifier_name_or_path="org/tiny")
    assert written == {f: tmp_path / "out" / f for f in ("sglang", "vllm", "speculators")}
    assert validate_sglang(written["sglang"]) == [] and validate_vllm(written["vllm"]) == []
    assert validate_speculators(written["speculators"]) == []
    assert_same(draft, load_native(written["sglang"], target=tiny_target))
    assert_same(draft, load_native(written["vllm"], target=tiny_target))
    assert_same(draft, load_speculators(written["speculators"], target=tiny_target))
    spec_cfg = json.loads((written["speculators"] / "config.json").read_text())
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    # Re-export from an export directory keeps its context length; "native" is the SGLang variant.
    again = export_checkpoint(written["speculators"], tmp_path / "again", format="native")
    cfg = json.loads((again["native"] / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and cfg["draftlab"]["engine"] == "sglang"
    with pytest.raises(ValueError, match="unknown export format"):
        export_checkpoint(ckpt, tmp_path / "x", format="gguf")


def test_export_builds_the_target_only_when_needed(trained, tiny_target, tmp_path):
    """A target factory is built for the embedding, or when it is the only source of the context length
    (then its value is written, never 2048); the target's config, or an explicit value, spares the build."""
    draft, ckpt = trained
    calls = []

    def build():
        calls.append(1)
        return tiny_target

    want = tiny_target.model.config.max_position_embeddings
    a = export_checkpoint(ckpt, tmp_path / "a", format="sglang", target=build,
                          verifier_config=tiny_target.model.config)
    b = export_checkpoint(ckpt, tmp_path / "b", format="vllm", target=build, max_position_embeddings=321)
    assert calls == []  # no embedding written, context length known: the target is never built
    assert json.loads((a["sglang"] / "config.json").read_text())["max_position_embeddings"] == want
    assert json.loads((b["vllm"] / "config.json").read_text())["max_position_embeddings"] == 321
    c = export_checkpoint(ckpt, tmp_path / "c", format="all", target=build)
    assert calls == [1]  # built once, for its context length
    for path in c.values():
        cfg = json.loads((path / "config.json").read_text())
        assert (cfg.get("transformer_layer_config") or cfg)["max_position_embeddings"] == want != 2048
    out = export_checkpoint(ckpt, tmp_path / "d", format="speculators", include_embedding=True, target=build)
    assert calls == [1, 1]
    assert_same(draft, load_speculators(out["speculators"]))  # self-contained now
    with pytest.raises(ValueError, match="target"):
        export_checkpoint(ckpt, tmp_path / "e", format="native", include_embedding=True)

    def unreachable():
        raise OSError("offline")  # a hub target on a machine without the hub: nothing names the context length

    f = export_checkpoint(ckpt, tmp_path / "f", format="vllm", target=unreachable)
    assert json.loads((f["vllm"] / "config.json").read_text())["max_position_embeddings"] == 2048


def test_export_yaml_composes_and_runs(trained, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from draftlab.cli.export import run_export

    draft, ckpt = trained
    out = tmp_path / "out"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="export", return_hydra_config=True, overrides=[
            f"checkpoint={ckpt}", f"output_dir={out}", "target=tiny_random", "include_embedding=true",
            "dtype=bfloat16", f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}"])
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    assert cfg.format == "all" and cfg.validate is True and cfg.speculative_tokens == 3
    written = run_export(cfg)
    assert set(written) == {"sglang", "vllm", "speculators"}
    back = load_native(written["vllm"])  # embedding included: no target needed
    assert back.fc.weight.dtype == torch.bfloat16
    assert torch.equal(back.embed_tokens.weight, draft.embed_tokens.weight.to(torch.bfloat16))
    assert torch.equal(back.d2t, draft.d2t)


def run_main(monkeypatch, *overrides: str) -> None:
    """The console script's own entry (``draftlab-export ...``), in-process: a subprocess would spend its
    time importing torch."""
    from hydra.core.global_hydra import GlobalHydra

    from draftlab.cli.export import main

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["draftlab-export", *overrides])
    try:
        main()
    finally:
        GlobalHydra.instance().clear()


def test_console_entry_point_end_to_end(tmp_path, monkeypatch, capsys):
    draft = tiny_draft()
    ckpt = write_lightning_checkpoint(draft, tmp_path / "run.ckpt")
    out = tmp_path / "exported"
    logs = f"paths.log_dir={tmp_path / 'logs'}"
    run_main(monkeypatch, f"checkpoint={ckpt}", f"output_dir={out}", "format=speculators", "speculative_tokens=4",
             "max_position_embeddings=1024", logs)
    assert f"speculators export: {out}" in capsys.readouterr().out
    assert validate_speculators(out) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 1024
    # The default target (smollm2_135m) names the verifier without being loaded.
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                     "architectures": ["LlamaForCausalLM"]}
    sd = load_speculators(out, require_embedding=False).state_dict()
    ref = draft.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref if k != "embed_tokens.weight")

    with pytest.raises(SystemExit) as err:
        run_main(monkeypatch, f"checkpoint={tmp_path / 'nope.ckpt'}", f"output_dir={out}", logs)
    assert err.value.code != 0 and "nope.ckpt" in capsys.readouterr().err


def test_console_export_takes_the_context_length_from_the_target(tmp_path, monkeypatch, capsys):
    """The default target (SmolLM2-135M, max_position_embeddings 8192) is read from its config.json, never
    built, and every format carries its context length (the old exporter wrote 2048 with a warning)."""
    import draftlab.targets

    def no_build(*a, **k):
        raise AssertionError("the target was built although its config.json names the context length")

    monkeypatch.setattr(draftlab.targets, "load_target", no_build)
    ckpt = write_lightning_checkpoint(tiny_draft(), tmp_path / "run.ckpt")
    out = tmp_path / "exported"
    run_main(monkeypatch, f"checkpoint={ckpt}", f"output_dir={out}", f"paths.log_dir={tmp_path / 'logs'}")
    printed = capsys.readouterr().out
    for fmt in ("sglang", "vllm", "speculators"):
        assert f"{fmt} export: {out / fmt}" in printed
        cfg = json.loads((out / fmt / "config.json").read_text())
        assert (cfg.get("transformer_layer_config") or cfg)["max_position_embeddings"] == 8192
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_console_script_is_registered():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("draftlab-export") == "draftlab.cli.export:main"


def test_a_failed_validation_leaves_nothing_that_looks_valid(trained, tmp_path, monkeypatch):
    """Exports are written to a hidden sibling, validated there, then renamed: a failing validator leaves no
    output directory (and no temporary one), and an earlier good export in its place stays untouched."""
    import draftlab.methods.eagle3.export.convert as convert

    _, ckpt = trained
    out = tmp_path / "out"

    def failing(path, fmt):
        raise ValueError(f"{path}: invalid (simulated)")

    monkeypatch.setattr(convert, "check_valid", failing)
    with pytest.raises(ValueError, match="simulated"):
        export_checkpoint(ckpt, out, format="native")
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())

    monkeypatch.undo()
    good = export_checkpoint(ckpt, out, format="native")["native"]
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    monkeypatch.setattr(convert, "check_valid", failing)
    with pytest.raises(ValueError, match="simulated"):
        export_checkpoint(ckpt, out, format="native")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())
