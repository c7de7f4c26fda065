"""TTT attention kernels against their torch reference, forward and backward (src/draftlab/kernels/ttt_attention.py).

The tensors live on ``DEVICE``: on a machine with CUDA the Triton kernels run compiled there (the GPU check runs
this file), elsewhere on the CPU under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it when there is no CUDA
device). Deliberately wrong kernels (their source with one expression changed) must fail the same check.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does the same)

from draftlab.kernels import ttt_attention as kernel  # noqa: E402
from draftlab.kernels._triton import triton  # noqa: E402
from draftlab.methods.eagle3.ttt import naive_ttt_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed (pip install -e '.[kernels]')")

# fp32 against the fp32 reference; low precision against the reference run in fp32 on the same (rounded) inputs
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _case(B=2, H=4, Hkv=2, T=37, hd=24, steps=3, rows=None, padded=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = T if rows is None else len(rows)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    inputs = dict(q=r(B, H, M, hd), k0=r(B, Hkv, T, hd), v0=r(B, Hkv, T, hd),
                  diag_k=[r(B, Hkv, M, hd) for _ in range(steps)], diag_v=[r(B, Hkv, M, hd) for _ in range(steps)])
    key_mask = None
    if padded:
        key_mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        key_mask[-1, T - 5:] = False  # the last sample is right-padded
    rows = None if rows is None else torch.tensor(rows, device=DEVICE)
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


# ---- the training dtype mix: an fp32 draft under bf16 autocast (trainer=gpu / fsdp: precision bf16-mixed) ----


def _mixed_case(T=40, steps=2, seed=1):
    """fp32 q and keys (the fp32 rotary tables promote them), bf16 values (a linear under autocast)."""
    inputs, extra, grad_out = _case(B=1, T=T, hd=16, steps=steps, seed=seed)
    inputs["v0"] = inputs["v0"].to(torch.bfloat16)
    inputs["diag_v"] = [v.to(torch.bfloat16) for v in inputs["diag_v"]]
    return inputs, extra, grad_out


def _grads_vs_fp32(impl, inputs, extra, grad_out, autocast: bool, **kw) -> dict:
    """Each output / gradient's largest error against the fp32 reference on the same inputs, relative to its
    largest value; asserts every gradient comes back in its input's dtype."""
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        got = _run(kernel.ttt_attention, inputs, extra, grad_out, impl=impl, **kw)
    up = {k: ([t.double() for t in v] if isinstance(v, list) else v.double()) for k, v in inputs.items()}
    want = _run(kernel.reference, up, extra, grad_out.double())
    names = ["out", "dq", "dk0", "dv0"] + [f"d{n}{i + 1}" for n in ("k", "v") for i in range(len(inputs["diag_k"]))]
    for name, g, leaf in zip(names[1:], got[1:], _leaves(inputs)):
        assert g.dtype == leaf.dtype, (impl, name, g.dtype, leaf.dtype)
    return {n: float((a.double() - b).abs().max() / b.abs().max()) for n, a, b in zip(names, got, want)}


def _within(errors: dict, inputs, compute_limit: float) -> None:
    """Each error under ``compute_limit``, or under bf16's rounding where the result itself is bf16 (a gradient
    handed back in its bf16 input's dtype)."""
    dtypes = [inputs["q"].dtype] + [t.dtype for t in _leaves(inputs)]  # out in q's dtype, then each leaf's grad
    over = {n: e for (n, e), d in zip(errors.items(), dtypes)
            if e > (max(compute_limit, 8e-3) if d == torch.bfloat16 else compute_limit)}
    assert not over, (over, errors)


@needs_triton
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16_autocast", "no_autocast"])
def test_triton_takes_the_training_dtype_mix(autocast):
    """fp32 q / k with bf16 v: Triton's dot products need one dtype, so the call casts to one (autocast's
    bf16 under autocast, else the promotion, fp32) and hands each gradient back in its input's dtype."""
    inputs, extra, grad_out = _mixed_case()
    errors = _grads_vs_fp32("triton", inputs, extra, grad_out, autocast)
    _within(errors, inputs, 3e-2 if autocast else 1e-4)  # bf16 compute; else fp32 on the given (bf16) values


def test_blockwise_under_autocast_is_within_the_references_own_error():
    """Under bf16 autocast the blockwise path runs forward and backward in fp32 (autocast off inside): its
    gradients are at least as close to the fp32 result as the torch reference's under the same autocast. (With
    the forward's matmuls in bf16 and the backward's recomputation in fp32, p no longer matched the saved lse
    and the error doubled.)"""
    inputs, extra, grad_out = _case(B=1, T=96, hd=16, steps=2, seed=2)
    ours = _grads_vs_fp32("blockwise", inputs, extra, grad_out, True, block=32)
    torch_path = _grads_vs_fp32("torch", inputs, extra, grad_out, True)
    worse = {n: (ours[n], torch_path[n]) for n in ours if ours[n] > torch_path[n] + 1e-6}
    assert not worse, worse


def test_blockwise_takes_the_training_dtype_mix():
    inputs, extra, grad_out = _mixed_case()
    errors = _grads_vs_fp32("blockwise", inputs, extra, grad_out, True, block=16)
    _within(errors, inputs, 1e-4)  # fp32 compute on the given (bf16-rounded) values


@needs_triton
def test_triton_refuses_blocks_under_16():
    inputs, extra, grad_out = _case(T=20)
    with pytest.raises(ValueError, match="at least 16"):
        _run(kernel.ttt_attention, inputs, extra, grad_out, impl="triton", block=8)


def test_auto_picks_triton_only_for_tested_dtypes(monkeypatch):
    monkeypatch.setattr(kernel, "triton_available", lambda device: True)
    assert kernel.resolve_impl("auto", "cuda", torch.bfloat16) == "triton"
    assert kernel.resolve_impl("auto", "cuda", torch.float32) == "triton"
    assert kernel.resolve_impl("auto", "cuda", torch.float64) == "blockwise"
    assert kernel.resolve_impl("auto", "cpu", torch.bfloat16) == "blockwise"


def test_compute_dtype_follows_autocast_else_promotion():
    a, b = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    assert kernel.compute_dtype(a, b) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernel.compute_dtype(a, b) == torch.bfloat16


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
    """draftlab/kernels/ttt_attention.py with ``old`` replaced by ``new`` inside ``function`` (exactly once), imported
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
    """The root ``kernels/`` folder (a README pointing to ``src/draftlab/kernels``) has no ``__init__.py``: run
    from the repository root, a regular package there would hide the ``kernels`` distribution transformers
    imports (Hugging Face's kernel hub)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert not (root / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin is not None:
        assert root / "kernels" not in Path(spec.origin).resolve().parents
