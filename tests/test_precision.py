"""``trainer.precision: auto``: bf16 autocast only where the CPU computes bf16 natively, and in the training key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from draftlab.utils import precision as P

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


@pytest.mark.parametrize(("cpuinfo", "native"), [(AVX2, False), (AMX, True), ("flags: avx512_bf16\n", True),
                                                  ("no flags line\n", False)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, cpuinfo, native):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert P.native_bf16_cpu(path) is native
    assert P.native_bf16_cpu(tmp_path / "missing") is False


def _spec(cfg):
    from draftlab.methods.registry import MethodSpec

    return MethodSpec(cfg.method)


def test_auto_resolves_per_machine_and_leaves_explicit_values(monkeypatch):
    monkeypatch.setattr(P, "native_bf16_cpu", lambda: False)
    assert P.resolve_precision("auto") == "32-true"
    assert P.resolve_precision("auto", "gpu") == "bf16-mixed"
    monkeypatch.setattr(P, "native_bf16_cpu", lambda: True)
    assert P.resolve_precision("auto") == "bf16-mixed"
    for explicit in ("32-true", "bf16-mixed", 32):
        assert P.resolve_precision(explicit) == explicit


def test_the_training_key_holds_the_resolved_precision(monkeypatch, tmp_path):
    from draftlab.stages.train import train_key
    from tests.test_configs import _compose

    cfg = _compose(["experiment=quickstart"], tmp_path)
    monkeypatch.setattr(P, "native_bf16_cpu", lambda: False)
    assert cfg.trainer.precision == "32-true"  # the config's resolver, read by Lightning and the key alike
    fp32_key = train_key(cfg, "data", _spec(cfg))
    explicit = OmegaConf.merge(cfg, {"trainer": {"precision": "32-true"}})
    assert train_key(explicit, "data", _spec(explicit)) == fp32_key  # auto on this CPU is the same run as asking for fp32
    monkeypatch.setattr(P, "native_bf16_cpu", lambda: True)
    assert cfg.trainer.precision == "bf16-mixed"
    assert train_key(cfg, "data", _spec(cfg)) != fp32_key
    auto = OmegaConf.merge(cfg, {"trainer": {"precision": "auto"}})  # trainer.precision=auto on the command line
    assert train_key(auto, "data", _spec(auto)) == train_key(cfg, "data", _spec(cfg))
