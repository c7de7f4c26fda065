"""``draftlab-export method=<m>``: dispatch through the method's ``export`` block, DFlash end to end, and the
rule that methods never import the export package (it dispatches to them, not the other way round)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.export import export_checkpoint
from draftlab.methods.dflash import export as dflash_export
from draftlab.methods.registry import MethodSpec
from draftlab.utils.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "draftlab"
# A one-layer, block-4 DFlash draft: every setting a command line must repeat to rebuild it from a .ckpt.
DFLASH = ["method.draft.block_size=4", "method.draft.num_layers=1"]


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports (at any depth, inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_methods_never_import_the_export_package():
    """Formats live with their methods; ``draftlab.export`` only dispatches to them."""
    files = sorted((SRC / "methods").rglob("*.py"))
    assert len(files) > 20
    back = [f"{f.relative_to(SRC)}: {m}" for f in files for m in imported_modules(f)
            if m == "draftlab.export" or m.startswith("draftlab.export.")]
    assert back == []


def test_the_export_package_names_no_method():
    """What stays in ``draftlab.export`` is method-agnostic: it reaches methods through the registry only."""
    named = [f"{f.name}: {m}" for f in sorted((SRC / "export").rglob("*.py")) for m in imported_modules(f)
             if m.startswith("draftlab.methods") and m != "draftlab.methods.registry"]
    assert named == []


def test_formats_come_from_the_method_block():
    eagle3, dflash = MethodSpec.from_name("eagle3"), MethodSpec.from_name("dflash")
    assert eagle3.export_formats == ["sglang", "vllm", "speculators"]
    assert eagle3.resolve_export_format("native") == ["sglang"]
    assert eagle3.resolve_export_format("both") == eagle3.resolve_export_format("all") == eagle3.export_formats
    assert dflash.export_formats == ["dflash"] and dflash.resolve_export_format("all") == ["dflash"]
    # A method training another's draft exports it as the base's.
    assert MethodSpec.from_name("draft_opd").export_formats == eagle3.export_formats


def test_an_unknown_format_names_the_methods_formats(tmp_path):
    dflash = MethodSpec.from_name("dflash")
    with pytest.raises(ConfigError, match=r"method 'dflash' has no export format 'vllm'; its formats: dflash, all$"):
        export_checkpoint(dflash, tmp_path / "missing.ckpt", tmp_path / "out", format="vllm")
    with pytest.raises(ConfigError, match=r"'gguf'; its formats: sglang, vllm, speculators, all, native, both"):
        MethodSpec.from_name("eagle3").resolve_export_format("gguf")
    with pytest.raises(ConfigError, match="method 'confu' declares no export formats"):
        MethodSpec.from_name("confu").resolve_export_format("all")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def dflash_draft(tiny_target):
    """A built DFlash draft whose weights are all distinct from a fresh build's (a wrong load shows)."""
    spec = MethodSpec.from_name("dflash", DFLASH)
    draft = spec.build_draft(tiny_target, None)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return spec, draft


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_format_all_writes_every_declared_format(dflash_draft, tiny_target, tmp_path):
    """``all`` is every format the block declares, each validated by its own validator."""
    spec, draft = dflash_draft
    art = spec.save(draft, tmp_path / "artifact", tiny_target)
    cfg = OmegaConf.create(OmegaConf.to_container(spec.cfg))
    cfg.export.formats.twin = cfg.export.formats.dflash
    cfg.export.validate.twin = cfg.export.validate.dflash
    twin = MethodSpec(cfg)
    written = export_checkpoint(twin, art, tmp_path / "out", format="all", target=tiny_target)
    assert written == {"dflash": tmp_path / "out" / "dflash", "twin": tmp_path / "out" / "twin"}
    for path in written.values():
        assert dflash_export.validate(path, target=tiny_target) == []
        assert same_weights(draft, dflash_export.load(path, target=tiny_target))


def test_a_failing_validator_leaves_nothing(dflash_draft, tiny_target, tmp_path):
    spec, draft = dflash_draft
    art = spec.save(draft, tmp_path / "artifact", tiny_target)
    cfg = OmegaConf.create(OmegaConf.to_container(spec.cfg))
    cfg.export.validate.dflash = {"_target_": "draftlab.methods.eagle3.export.validate_vllm", "_partial_": True}
    with pytest.raises(ValueError, match="would not be a valid dflash dflash export: .*architecture"):
        export_checkpoint(MethodSpec(cfg), art, tmp_path / "out", format="dflash", target=tiny_target)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def run_cli(monkeypatch, *overrides: str) -> None:
    """``draftlab-export ...`` through the console script's entry, in-process."""
    from hydra.core.global_hydra import GlobalHydra

    from draftlab.cli.export import main

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["draftlab-export", *overrides])
    try:
        main()
    finally:
        GlobalHydra.instance().clear()


def lightning_checkpoint(spec, draft, target, path: Path) -> Path:
    """What a Lightning checkpoint of DFlash's training module holds: the module's state dict and its config."""
    module = spec.build_module(draft, target)
    ckpt = {"state_dict": module.state_dict(), "epoch": 1, "global_step": 8}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return path


def dispatch_checks(calls: list[Path], out: Path) -> int:
    """Validator calls on the directory the dispatch writes ``out`` in (its hidden sibling, before the rename)."""
    return sum(p.parent == out.parent and p.name.startswith(f".{out.name}.tmp-") for p in calls)


def test_dflash_exports_from_the_command_line(dflash_draft, tiny_target, tmp_path, monkeypatch, capsys):
    """Artifact directory and Lightning .ckpt -> ``format=dflash``, validated by DFlash's validator on the
    written directory (besides the artifact loader's and the writer's own checks; not with ``validate=false``);
    the export reloads equal."""
    spec, draft = dflash_draft
    art = spec.save(draft, tmp_path / "artifact", tiny_target)
    ckpt = lightning_checkpoint(spec, draft, tiny_target, tmp_path / "last.ckpt")
    calls = []
    real = dflash_export.validate

    def counting(path, *, target=None, **kind):
        calls.append(Path(path))
        return real(path, target=target, **kind)

    monkeypatch.setattr(dflash_export, "validate", counting)
    common = ["method=dflash", "target=tiny_random", *DFLASH, f"paths.log_dir={tmp_path / 'logs'}"]
    for source, fmt in ((art, "dflash"), (ckpt, "all")):
        out = tmp_path / f"from_{source.stem}"
        calls.clear()
        run_cli(monkeypatch, *common, f"checkpoint={source}", f"format={fmt}", f"output_dir={out}")
        where = out / "dflash" if fmt == "all" else out
        assert f"{fmt if fmt != 'all' else 'dflash'} export: {where}" in capsys.readouterr().out
        assert dispatch_checks(calls, where) == 1 and real(where, target=tiny_target) == []
        assert same_weights(draft, dflash_export.load(where, target=tiny_target))
    calls.clear()
    run_cli(monkeypatch, *common, f"checkpoint={art}", "format=dflash", f"output_dir={tmp_path / 'nv'}",
            "validate=false")
    assert calls and dispatch_checks(calls, tmp_path / "nv") == 0

    with pytest.raises(SystemExit) as err:
        run_cli(monkeypatch, *common, f"checkpoint={art}", "format=speculators", f"output_dir={tmp_path / 'x'}")
    assert err.value.code == 2
    assert "method 'dflash' has no export format 'speculators'; its formats: dflash, all" in capsys.readouterr().err
