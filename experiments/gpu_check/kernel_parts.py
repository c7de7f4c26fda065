"""The GPU check's kernel parts: the training kernels right (every gradient against an fp32 reference, with
thresholds) and fast (time, peak memory, OOM as a result), and a whole TTT-7 step of a Llama-3-8B draft.
``--device cpu`` runs each at tiny sizes (Triton under its interpreter)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
from parts import Context, _run

# Largest error of each output / gradient, relative to the fp64 reference's largest value: bf16 compute (the
# inputs rounded to bf16, fp32 accumulation) and fp32 compute (TF32 is off: IEEE dot products).
THRESHOLDS = {"bfloat16": 3e-2, "float32": 1e-4}
# Tile sizes tried for the Triton kernels on the GPU (rows = keys per block); the CPU runs the smallest.
TRITON_BLOCKS = (32, 64, 128)


def kernel_tests(ctx: Context) -> dict:
    """``tests/kernels`` on the device: compiled Triton on a GPU (interpreted on the CPU), mutants included."""
    # On the CPU the suite runs these files itself: here only the training dtype mix, to keep the script alive.
    select = [] if ctx.gpu else ["-k", "dtype_mix"]
    rc, tail = _run([sys.executable, "-m", "pytest", "tests/kernels", *select, "-n", "0", "-q", "-p", "no:cacheprovider"],
                    ctx, "kernel_tests.log", timeout=240)
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    if rc != 0:
        raise AssertionError(f"tests/kernels on {ctx.device}: exit {rc}: {tail[-1500:]}")
    return {"summary": summary}


def _inputs(ctx: Context, *, H, Hkv, T, hd, steps, dtypes, padding=None, rows=None, seed=0):
    """Leaves ``q, k0, v0, dk.., dv..`` (dtypes: q/k dtype, v dtype), their extras and an upstream grad."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    M = T if rows is None else len(rows)
    qk, v = dtypes

    def r(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(device=ctx.device, dtype=dtype)

    leaves = [r(1, H, M, hd, dtype=qk), r(1, Hkv, T, hd, dtype=qk), r(1, Hkv, T, hd, dtype=v)]
    leaves += [r(1, Hkv, M, hd, dtype=qk) for _ in range(steps)] + [r(1, Hkv, M, hd, dtype=v) for _ in range(steps)]
    key_mask = None
    if padding is not None:
        key_mask = torch.ones(1, T, dtype=torch.bool, device=ctx.device)
        key_mask[:, :padding[0]] = False
        key_mask[:, T - padding[1]:] = False
    extra = {"rows": None if rows is None else torch.tensor(rows, device=ctx.device), "key_mask": key_mask}
    return leaves, extra, r(1, H, M, hd, dtype=torch.float32)


def _poison(device) -> None:
    """Fill the CUDA allocator's free blocks with NaN: a kernel's output or gradient allocated with
    ``torch.empty`` and left partly unwritten then shows as NaN instead of as yesterday's numbers."""
    if torch.device(device).type == "cuda":
        free = int(min(torch.cuda.mem_get_info()[0] * 0.5, 8 * 2**30)) // 4
        block = torch.full((free,), float("nan"), device=device)
        del block


def _fwd_bwd(impl, leaves, extra, grad, steps, *, autocast=False, **kw):
    from draftlab.kernels.ttt_attention import reference, ttt_attention

    xs = [t.detach().clone().requires_grad_(True) for t in leaves]
    _poison(xs[0].device)
    fn = reference if impl == "reference" else (lambda *a, **k: ttt_attention(*a, impl=impl, **k, **kw))
    with torch.autocast(xs[0].device.type, dtype=torch.bfloat16, enabled=autocast):
        out = fn(xs[0], xs[1], xs[2], xs[3:3 + steps], xs[3 + steps:], xs[0].shape[-1] ** -0.5, **extra)
    grads = torch.autograd.grad(out, xs, grad.to(out.dtype))
    return [out.detach()] + list(grads)


def ttt_right(ctx: Context) -> dict:
    """Every output and gradient (q, k0, v0, each diagonal key and value) of blockwise and Triton against the
    reference in fp64 on the same inputs, per case, with a threshold per compute dtype. Rows a padded prefix
    hides from every key are compared only where they see one (the reference mixes masked keys there)."""
    from draftlab.kernels._triton import available

    hd_list = (64, 128) if ctx.gpu else (16,)
    T = 256 if ctx.gpu else 24
    impls = ["blockwise"] + (["triton"] if available(ctx.device) else [])
    cases = {
        "bf16": dict(dtypes=(torch.bfloat16, torch.bfloat16)),
        "autocast_mix": dict(dtypes=(torch.float32, torch.bfloat16), autocast=True),
        "fp32": dict(dtypes=(torch.float32, torch.float32)),
        "right_padded": dict(dtypes=(torch.bfloat16, torch.bfloat16), padding=(0, 7)),
        "left_padded": dict(dtypes=(torch.bfloat16, torch.bfloat16), padding=(5, 0)),
        "rows_subset": dict(dtypes=(torch.bfloat16, torch.bfloat16), rows=[3, 0, T - 1, T // 2, 7, 7]),
    }
    out, failures = {}, []
    for hd in hd_list:
        for name, case in cases.items():
            case = dict(case)
            autocast = case.pop("autocast", False)
            leaves, extra, grad = _inputs(ctx, H=8, Hkv=2, T=T, hd=hd, steps=3, **case)
            want = _fwd_bwd("reference", [t.double() for t in leaves], extra, grad.double(), 3)
            seen = slice(case["padding"][0], None) if "padding" in case else slice(None)
            compute = "bfloat16" if autocast or case["dtypes"][0] == torch.bfloat16 else "float32"
            for impl in impls:
                got = _fwd_bwd(impl, leaves, extra, grad, 3, autocast=autocast)
                errs = [float((a[..., seen, :].double() - b[..., seen, :]).abs().max() / b.abs().max())
                        if i < 2 else float((a.double() - b).abs().max() / b.abs().max())
                        for i, (a, b) in enumerate(zip(got, want))]
                nan = any(not torch.isfinite(g).all() for g in got)
                worst = max(errs)
                key = f"hd{hd}/{name}/{impl}"
                out[key] = {"max_rel_err": round(worst, 6), "threshold": THRESHOLDS[compute], "nan": nan}
                if nan or worst > THRESHOLDS[compute]:
                    failures.append(key)
    if failures:
        raise AssertionError(f"over threshold or NaN: {failures}: {out}")
    return out


def _timed(ctx: Context, fn, reps: int) -> dict:
    """Median seconds of ``fn()`` (CUDA events on a GPU) and peak memory above what was allocated before."""
    times = []
    for _ in range(reps + 1):  # the first call compiles / warms up and is dropped (reps = 0: one call, kept)
        if ctx.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    res = {"ms": round(statistics.median(times[1:] or times) * 1e3, 2)}
    if ctx.gpu:
        res["peak_gib"] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)
    return res


def _guarded(ctx: Context, fn, reps: int) -> dict:
    """``_timed``, with an out-of-memory or any other failure recorded as the result (one implementation's
    failure never hides the others)."""
    try:
        return _timed(ctx, fn, reps)
    except torch.OutOfMemoryError:
        return {"oom": True}
    except Exception as e:  # noqa: BLE001 - recorded, the part goes on
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        if ctx.gpu:
            torch.cuda.empty_cache()


def ttt_fast(ctx: Context) -> dict:
    """Forward + backward of TTT attention at step 7 (32 / 8 heads of 128, bf16) for torch, blockwise, Triton at
    each tile size and flex with its block mask built once (its build timed apart), at T = 2k / 4k / 8k."""
    from draftlab.kernels import ttt_attention as k
    from draftlab.kernels._triton import available

    H, Hkv, hd, lengths, reps = (32, 8, 128, (2048, 4096, 8192), 3) if ctx.gpu else (4, 2, 16, (48,), 1)
    blocks = TRITON_BLOCKS if ctx.gpu else (16,)
    out: dict = {"heads": H, "kv_heads": Hkv, "head_dim": hd, "steps": 7}
    for T in lengths:
        leaves, extra, grad = _inputs(ctx, H=H, Hkv=Hkv, T=T, hd=hd, steps=6,
                                      dtypes=(torch.bfloat16, torch.bfloat16))
        xs = [t.requires_grad_(True) for t in leaves]

        def run(impl, xs=xs, extra=extra, grad=grad, **kw):
            o = k.ttt_attention(xs[0], xs[1], xs[2], xs[3:9], xs[9:], hd ** -0.5, impl=impl, **extra, **kw)
            o.backward(grad.to(o.dtype))

        row = {"torch": _guarded(ctx, lambda: run("torch"), reps),
               "blockwise": _guarded(ctx, lambda: run("blockwise"), reps)}
        if available(ctx.device):
            for b in blocks:
                row[f"triton_b{b}"] = _guarded(ctx, lambda b=b: run("triton", block=b), reps)
        if ctx.gpu:
            row["flex"] = _flex_cached(ctx, xs, grad, hd, reps)
        out[f"T={T}"] = row
    return out


def _flex_cached(ctx: Context, xs, grad, hd: int, reps: int) -> dict:
    """Compiled flex_attention over ``[prefix | step keys]`` with the TTT block mask built once and reused, as a
    training loop would; the mask's build time is reported apart from the kernel's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        q, k0, v0 = xs[:3]
        T, M, steps = k0.shape[2], q.shape[2], 6

        def mask_mod(b, h, m, s):
            return torch.where(s < T, s <= m, (s - T) % M == m)

        t0 = time.perf_counter()
        mask = create_block_mask(mask_mod, None, None, M, T + steps * M, device=q.device, _compile=True)
        torch.cuda.synchronize()
        build = time.perf_counter() - t0
        fn = torch.compile(flex_attention, dynamic=False)

        def run():
            keys = torch.cat([k0, *xs[3:9]], dim=2)
            values = torch.cat([v0, *xs[9:]], dim=2)
            o = fn(q, keys, values, block_mask=mask, scale=hd ** -0.5, enable_gqa=True)
            o.backward(grad.to(o.dtype))

        return {"mask_build_s": round(build, 3), **_guarded(ctx, run, reps)}
    except torch.OutOfMemoryError:
        return {"oom": True}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def soft_ce(ctx: Context) -> dict:
    """The soft cross-entropy right (chunked and Triton against the fp32 reference, loss and dlogits) and fast
    (forward + backward of 8k rows of a 32k draft vocabulary in bf16: one TTT step's loss at T = 8k)."""
    from draftlab.kernels import soft_cross_entropy as sce

    n, v = (8192, 32000) if ctx.gpu else (64, 1000)
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(n, v, generator=gen) * 3).to(device=ctx.device, dtype=torch.bfloat16)
    p = torch.softmax(torch.randn(n, v, generator=gen), -1).to(ctx.device)
    impls = ["chunked"] + (["triton"] if sce._triton.available(ctx.device) else [])
    ref_z = z.float().requires_grad_(True)
    ref = sce.soft_cross_entropy(ref_z, p, impl="torch")
    ref.sum().backward()
    out, failures = {}, []
    for impl in impls:
        zz = z.clone().requires_grad_(True)
        loss = sce.soft_cross_entropy(zz, p, impl=impl)
        loss.sum().backward()
        err = max(float((loss - ref).abs().max() / ref.abs().max()),
                  float((zz.grad.float() - ref_z.grad).abs().max() / ref_z.grad.abs().max()))
        out[impl] = {"max_rel_err": round(err, 6), "threshold": THRESHOLDS["bfloat16"]}
        if err > THRESHOLDS["bfloat16"]:
            failures.append(impl)
        zz = z.clone().requires_grad_(True)
        out[impl].update(_guarded(ctx, lambda zz=zz, impl=impl: sce.soft_cross_entropy(zz, p, impl=impl).sum().backward(),
                                  3))
    if failures:
        raise AssertionError(f"soft cross-entropy over threshold: {failures}: {out}")
    return out


def ttt_step(ctx: Context) -> dict:
    """A whole TTT-7 training step (forward + backward, bf16 autocast, fp32 draft) of a Llama-3-8B-shaped EAGLE-3
    draft from random target features (no target: the features and the target's last hidden state are drawn),
    per attention choice at T = 2k / 4k / 8k: step time, peak memory, and both as ratios to the torch path."""
    from draftlab.methods.eagle3.config import Eagle3Config
    from draftlab.methods.eagle3.model import Eagle3Draft
    from draftlab.methods.eagle3.module import Eagle3Module

    if ctx.gpu:
        d, heads, kv, inter, vocab, dv, lengths = 4096, 32, 8, 14336, 128256, 32000, (2048, 4096, 8192)
    else:
        d, heads, kv, inter, vocab, dv, lengths = 64, 4, 2, 128, 1000, 256, (24,)
    cfg = Eagle3Config(hidden_size=d, intermediate_size=inter, num_heads=heads, num_kv_heads=kv, head_dim=d // heads,
                       vocab_size=vocab, draft_vocab_size=dv, aux_layer_ids=[1, 2, 3])
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(ctx.device)
    head = (torch.randn(vocab, d) * d ** -0.5).to(device=ctx.device, dtype=torch.bfloat16)
    from draftlab.kernels._triton import available

    choices = ["torch", "blockwise"] + (["triton"] if available(ctx.device) else []) + (["flex"] if ctx.gpu else [])
    out: dict = {"hidden": d, "vocab": vocab, "draft_vocab": dv, "ttt_length": 7}
    for T in lengths:
        gen = torch.Generator().manual_seed(T)
        batch = {"input_ids": torch.randint(0, vocab, (1, T), generator=gen).to(ctx.device),
                 "aux_hidden": torch.randn(1, T, 3 * d, generator=gen).to(ctx.device, torch.bfloat16),
                 "last_hidden": torch.randn(1, T, d, generator=gen).to(ctx.device, torch.bfloat16),
                 "loss_mask": torch.ones(1, T, dtype=torch.long, device=ctx.device),
                 "attention_mask": torch.ones(1, T, dtype=torch.long, device=ctx.device)}
        row = {}
        for attention in choices:
            module = Eagle3Module(draft, None, ttt_length=7, target_lm_head=head, attention=attention).to(ctx.device)

            def step(module=module, batch=batch):
                draft.zero_grad(set_to_none=True)
                with torch.autocast(ctx.device.split(":")[0], dtype=torch.bfloat16):
                    loss = module.loss(batch).loss
                loss.backward()

            row[attention] = _guarded(ctx, step, 2 if ctx.gpu else 0)
        base = row.get("torch", {})
        for r in row.values():
            if "ms" in r and "ms" in base:
                r["time_vs_torch"] = round(r["ms"] / base["ms"], 2)
            if "peak_gib" in r and "peak_gib" in base:
                r["memory_vs_torch"] = round(r["peak_gib"] / base["peak_gib"], 2)
        out[f"T={T}"] = row
    return out

