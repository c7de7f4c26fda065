"""Soft-target cross-entropy: chunked torch and Triton paths against the torch reference, forward and backward.
On a machine with CUDA the inputs live there and Triton runs compiled (the GPU check runs this file); elsewhere
on the CPU under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module imports triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

from draftlab.kernels import soft_cross_entropy as sce  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _inputs(shape, dtype, kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(shape, generator=gen) * 3).to(dtype)
    if kind == "dist":
        p = torch.softmax(torch.randn(shape, generator=gen), -1)
    elif kind == "onehot":
        p = torch.nn.functional.one_hot(torch.randint(shape[-1], shape[:-1], generator=gen), shape[-1]).float()
    else:  # rows of a distribution, every other one masked to zeros
        p = torch.softmax(torch.randn(shape, generator=gen), -1)
        p.view(-1, shape[-1])[::2] = 0
    return z.to(DEVICE), p.to(DEVICE)


def check(module, shape, dtype, kind, impl, **kw):
    """Loss and dlogits (random upstream grad) of ``impl`` against the reference on the same inputs."""
    z, p = _inputs(shape, dtype, kind)
    g = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    z_ref = z.clone().requires_grad_(True)
    ref = module.soft_cross_entropy(z_ref, p, impl="torch")
    (ref * g).sum().backward()
    z_got = z.clone().requires_grad_(True)
    got = module.soft_cross_entropy(z_got * 1 if kw.get("inplace") else z_got, p, impl=impl, **kw)
    (got * g).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(got, ref.detach(), rtol=tol, atol=tol * max(1.0, ref.abs().max().item()))
    torch.testing.assert_close(z_got.grad.float(), z_ref.grad.float(), rtol=tol, atol=tol)


SHAPES = [(1, 7), (5, 100), (33, 1000), (5, 4099), (2, 3, 100)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["dist", "onehot", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_matches_reference(shape, kind, dtype):
    check(sce, shape, dtype, kind, "chunked", chunk_elements=150)  # chunks smaller than N


@pytest.mark.parametrize("shape", [(1, 7), (5, 100), (33, 100), (3, 4099), (2, 3, 100)])
@pytest.mark.parametrize("kind", ["dist", "onehot", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(shape, kind, dtype):
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    check(sce, shape, dtype, kind, "triton")
    check(sce, shape, dtype, kind, "triton", inplace=True)


def test_bad_arguments():
    with pytest.raises(ValueError):
        sce.soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 3), impl="nope")
    with pytest.raises(ValueError):
        sce.soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 4))


def test_inplace_misuse_is_an_error():
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    z, p = _inputs((4, 50), torch.float32, "dist")
    w = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    logits = w * 2  # a non-leaf, also consumed by an op that saves it for backward
    # the other op is recorded first, so its backward runs after ours and would read overwritten logits
    other = (logits * w).sum()
    loss = sce.soft_cross_entropy(logits, p, impl="triton", inplace=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_mutant_fails_the_same_check(tmp_path):
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    src = Path(sce.__file__).read_text()
    pattern = "dz = g * (tl.exp(z - lse) * sum_p - p)"
    assert src.count(pattern) == 1
    path = tmp_path / "soft_ce_mutant.py"
    path.write_text(src.replace(pattern, "dz = g * (tl.exp(z - lse) - p)"))
    spec = importlib.util.spec_from_file_location("soft_ce_mutant", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    with pytest.raises(AssertionError):
        check(mutant, (5, 100), torch.float32, "masked", "triton")


def test_triton_fp16_and_wide_rows():
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    check(sce, (5, 1000), torch.float16, "dist", "triton")
    check(sce, (33, 100), torch.float16, "masked", "triton", inplace=True)


def test_inplace_is_safe_when_the_other_backward_runs_first():
    pytest.importorskip("triton", reason="the Triton path needs the triton package")
    _, p = _inputs((4, 50), torch.float32, "dist")
    w = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    grads = []
    for inplace in (False, True):
        w.grad = None
        logits = w * 2
        loss = sce.soft_cross_entropy(logits, p, impl="triton", inplace=inplace).sum() + (logits * w).sum()
        loss.backward()  # the product was recorded last, so its backward reads the logits before ours
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


def test_one_chunk_equals_many():
    z, p = _inputs((33, 100), torch.float32, "dist")
    one = sce.soft_cross_entropy(z, p, impl="chunked")
    many = sce.soft_cross_entropy(z, p, impl="chunked", chunk_elements=100)  # one row per chunk
    torch.testing.assert_close(many, one, rtol=0, atol=0)


def test_autocast_leaves_the_fused_paths_alone():
    """Under bf16 autocast (bf16-mixed training) the chunked and Triton paths give what they give without it:
    they compute in fp32 from the dtypes they are handed."""
    z, p = _inputs((5, 300), torch.float32, "dist")
    impls = ["chunked"] + (["triton"] if sce._triton.available(DEVICE) else [])
    for impl in impls:
        plain = sce.soft_cross_entropy(z, p, impl=impl)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            mixed = sce.soft_cross_entropy(z, p, impl=impl)
        assert mixed.dtype == torch.float32 and torch.equal(mixed, plain), impl
