"""TTT attention kernels against their torch reference, forward and backward (kernels/ttt_attention.py).

The Triton kernels run on CPU under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it). Deliberately wrong
kernels (their source with one expression changed) must fail the same check.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from draftlab.kernels import ttt_attention as kernel  # noqa: E402
from draftlab.kernels._triton import triton  # noqa: E402
from draftlab.methods.eagle3.ttt import naive_ttt_attention  # noqa: E402

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed (pip install -e '.[kernels]')")

# fp32 against the fp32 reference; low precision against the reference run in fp32 on the same (rounded) inputs
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _case(B=2, H=4, Hkv=2, T=37, hd=24, steps=3, rows=None, padded=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = T if rows is None else len(rows)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    inputs = dict(q=r(B, H, M, hd), k0=r(B, Hkv, T, hd), v0=r(B, Hkv, T, hd),
                  diag_k=[r(B, Hkv, M, hd) for _ in range(steps)], diag_v=[r(B, Hkv, M, hd) for _ in range(steps)])
    key_mask = None
    if padded:
        key_mask = torch.ones(B, T, dtype=torch.bool)
        key_mask[-1, T - 5:] = False  # the last sample is right-padded
    rows = None if rows is None else torch.tensor(rows)
    return inputs, dict(rows=rows, key_mask=key_mask), r(B, H, M, hd)


def _leaves(inputs):
    return [inputs["q"], inputs["k0"], inputs["v0"], *inputs["diag_k"], *inputs["diag_v"]]


def _run(fn, inputs, extra, grad_out, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in _leaves(inputs)]
    q, k0, v0 = leaves[:3]
    n = len(inputs["diag_k"])
    out = fn(q, k0, v0, leaves[3:3 + n], leaves[3 + n:], 0.3, **extra, **kw)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, grad_out))


def check_against_reference(module, impl: str, inputs, extra, grad_out, **kw) -> None:
    """``module.ttt_attention(impl=...)``'s output and input grads equal the reference's (computed in fp32
    for low-precision inputs) to the dtype's tolerance."""
    dtype = inputs["q"].dtype
    got = _run(module.ttt_attention, inputs, extra, grad_out, impl=impl, **kw)
    wide = torch.promote_types(dtype, torch.float32)
    up = {k: ([t.to(wide) for t in v] if isinstance(v, list) else v.to(wide)) for k, v in inputs.items()}
    want = _run(kernel.reference, up, extra, grad_out.to(wide))
    names = ["out", "dq", "dk0", "dv0"] + [f"d{n}{i + 1}" for n in ("k", "v") for i in range(len(inputs["diag_k"]))]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == dtype, name
        scale = b.abs().max().clamp_min(1.0)
        err = (a.to(wide) - b).abs().max() / scale
        assert err <= TOLERANCE[dtype], f"{impl} {name}: max error {float(err):.3g} (relative to {float(scale):.3g})"


CASES = {
    "gqa_padded_3_steps": dict(),
    "step_0": dict(steps=0),
    "one_head_no_padding": dict(B=1, H=1, Hkv=1, T=16, hd=16, steps=1, padded=False),
    "mha_7_steps_odd_head_dim": dict(B=1, H=3, Hkv=3, T=21, hd=12, steps=7),
    "query_rows_subset": dict(rows=[3, 0, 20, 36, 7, 7], steps=2),
    "left_padded_first_row_sees_nothing": dict(B=1, T=9, steps=0),
}


# the brute-force mask is defined for all rows of real sequences
@pytest.mark.parametrize("case", [c for c in CASES if "rows" not in CASES[c] and not c.startswith("left")])
def test_reference_equals_the_concatenated_key_attention(case):
    """The reference is the brute-force attention over all steps' keys under the explicit TTT mask."""
    spec = dict(CASES[case], dtype=torch.float64)
    inputs, extra, _ = _case(**spec)
    keys = [inputs["k0"], *inputs["diag_k"]]
    values = [inputs["v0"], *inputs["diag_v"]]
    want = naive_ttt_attention(inputs["q"], keys, values, extra["key_mask"], 0.3)
    got = kernel.reference(inputs["q"], inputs["k0"], inputs["v0"], inputs["diag_k"], inputs["diag_v"], 0.3,
                           key_mask=extra["key_mask"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _left_padded(inputs, extra):
    if extra["key_mask"] is not None and extra["key_mask"].shape[1] == 9:
        extra["key_mask"][:, :2] = False  # rows 0 and 1 see no step-0 key at step 0
    return inputs, extra


@pytest.mark.parametrize("block", [4, None])
@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_equals_the_reference(case, block):
    inputs, extra, grad_out = _case(**CASES[case])
    inputs, extra = _left_padded(inputs, extra)
    if case.startswith("left"):
        # The reference gives such a row a uniform mix of masked keys; the blockwise path gives it zero.
        # Either is ignored by training (the row is padding); the other rows must agree.
        got = _run(kernel.ttt_attention, inputs, extra, grad_out, impl="blockwise", block=block)[0]
        want = _run(kernel.reference, inputs, extra, grad_out)[0]
        torch.testing.assert_close(got[:, :, 2:], want[:, :, 2:], rtol=1e-5, atol=1e-5)
        assert torch.all(got[:, :, :2] == 0)
        return
    check_against_reference(kernel, "blockwise", inputs, extra, grad_out, block=block)


@needs_triton
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("left")])
def test_triton_equals_the_reference(case):
    inputs, extra, grad_out = _case(**CASES[case])
    check_against_reference(kernel, "triton", inputs, extra, grad_out)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision(dtype):
    inputs, extra, grad_out = _case(B=1, T=24, hd=16, steps=2, dtype=dtype)
    check_against_reference(kernel, "triton", inputs, extra, grad_out)


def test_blockwise_low_precision():
    inputs, extra, grad_out = _case(B=1, T=24, hd=16, steps=2, dtype=torch.bfloat16)
    check_against_reference(kernel, "blockwise", inputs, extra, grad_out, block=8)


@needs_triton
def test_triton_rows_without_keys_get_zero_output_and_grads():
    inputs, extra, grad_out = _case(B=1, T=9, steps=0)
    extra["key_mask"][:, :2] = False
    out, dq, *_ = _run(kernel.ttt_attention, inputs, extra, grad_out, impl="triton")
    assert torch.all(out[:, :, :2] == 0) and torch.all(dq[:, :, :2] == 0)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


def test_flex_forward_equals_the_reference():
    """flex_attention has no CPU backward in this torch: its forward (eager) is checked here, its backward
    where it runs (the GPU check)."""
    inputs, extra, _ = _case(rows=[3, 0, 20, 36, 7], steps=2)
    with torch.no_grad():
        got = kernel.ttt_attention(*(_leaves(inputs)[:3]), inputs["diag_k"], inputs["diag_v"], 0.3, **extra,
                                   impl="flex")
        want = kernel.reference(*(_leaves(inputs)[:3]), inputs["diag_k"], inputs["diag_v"], 0.3, **extra)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_impl_names():
    assert kernel.resolve_impl("auto", "cpu") == "blockwise"
    assert kernel.resolve_impl("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="auto, torch, blockwise, triton, flex; got 'fast'"):
        kernel.resolve_impl("fast", "cpu")
    with pytest.raises(ValueError, match="pass rows"):
        inputs, extra, _ = _case(T=8)
        kernel.ttt_attention(inputs["q"][:, :, :4], inputs["k0"], inputs["v0"], [], [], 0.3, impl="blockwise")


# ------------------------------------------------------------------------------------------------------
# mutants: the same check must catch a kernel that is wrong by one step, one key or one backward term

MUTANTS = {
    # forward: the newest step's diagonal key is left out (a loop off by one step)
    "fwd_diagonal_off_by_one_step": ("_ttt_fwd", "for i in range(NDIAG):", "for i in range(NDIAG - 1):", "triton"),
    # forward: a row no longer sees its own step-0 key (causal mask off by one)
    "fwd_prefix_off_by_one": ("_ttt_fwd", "ok = (offs_n[None, :] <= rows[:, None])",
                              "ok = (offs_n[None, :] < rows[:, None])", "triton"),
    # backward: dq without the softmax's row term
    "bwd_dq_without_delta": ("_ttt_bwd_rows", "ds = p * (dp - delta[:, None])", "ds = p * dp", "triton"),
    # backward: prefix dk/dv skip the query block holding the key block's own rows
    "bwd_prefix_skips_a_block": ("_ttt_bwd_prefix", "lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if POSITIONS else 0",
                                 "lo = (pid_n * BLOCK_N // BLOCK_M + 1) * BLOCK_M if POSITIONS else 0", "triton"),
    # blockwise backward: the diagonal's gradient forgets the step's value term
    "blockwise_bwd_diagonal": ("backward", "ds = p * ((dob * vd).sum(-1, keepdim=True) - db)", "ds = p * (-db)",
                               "blockwise"),
}


def _mutant(tmp_path, function: str, old: str, new: str):
    """kernels/ttt_attention.py with ``old`` replaced by ``new`` inside ``function`` (exactly once), imported
    from a file (Triton's jit reads kernel source from files)."""
    source = inspect.getsource(kernel)
    start = source.index(f"def {function}(")
    end = source.find("\n    def ", start + 1)
    end = len(source) if end < 0 else end
    body = source[start:end]
    assert body.count(old) == 1, f"'{old}' occurs {body.count(old)} times in {function}"
    path = tmp_path / f"mutant_{function}.py"
    path.write_text(source[:start] + body.replace(old, new) + source[end:])
    spec = importlib.util.spec_from_file_location(f"ttt_attention_mutant_{function}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_wrong_kernel_fails_the_check(tmp_path, name):
    function, old, new, impl = MUTANTS[name]
    if impl == "triton" and triton is None:
        pytest.skip("triton is not installed")
    mutant = _mutant(tmp_path, function, old, new)
    inputs, extra, grad_out = _case()
    kw = {"block": 16} if impl == "blockwise" else {}
    with pytest.raises(AssertionError, match="max error"):
        check_against_reference(mutant, impl, inputs, extra, grad_out, **kw)
    check_against_reference(kernel, impl, inputs, extra, grad_out, **kw)  # the unmutated kernel passes


def test_the_kernels_folder_does_not_shadow_an_installed_kernels_package():
    """``kernels/`` has no ``__init__.py``: run from the repository root, a regular package there would hide the
    ``kernels`` distribution transformers imports (Hugging Face's kernel hub); ``draftlab.kernels`` reaches it
    through ``src/draftlab/kernels`` instead."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert not (root / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin is not None:
        assert root / "kernels" not in Path(spec.origin).resolve().parents
