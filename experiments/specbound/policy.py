"""SpecBound's exit policy on held-out text, and what a partial-depth draft costs on this machine.

    python experiments/specbound/policy.py RUN --out experiments/specbound/policy

Both parts use a ``draftlab-train experiment=specbound_smollm2`` run (its config, data split and heads):

(a) **Policy grid.** The heads score every held-out loss position of the run's validation split once;
    each (alpha, tau, d_max) is then applied to those scores: exit rate, mean exit layer, precision of
    exits and the simulated tokens per round (consecutive positions whose first exit agrees with the final
    layer, capped at w_max, plus the completion pass's token), as ``SpecBoundModule`` validates. It picks
    settings for decoding runs without decoding them; it measures no speed.
(b) **Cost model.** Median wall time of one token through layers [0, l) plus one exit-head check (the
    final norm and LM head over the full vocabulary) against one full AR step, over the same context.

Writes ``<out>.md`` (both tables) and ``<out>.png`` (simulated tokens per round against tau).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from analysis.markdown import markdown_table
from analysis.results import training_record

CHUNK = 256  # positions per LM-head chunk ([chunk, V] logits at a time)


@torch.no_grad()
def held_out_scores(cfg, heads, target, alphas, max_batches: int | None):
    """Per exit layer: ACT confidence ``{alpha: [n]}`` and agreement with the final layer ``[n]`` over the
    held-out loss positions, plus each position's (row, index) so chains follow the text."""
    from draftlab.methods.registry import MethodSpec
    from draftlab.methods.specbound.heads import act_temperature
    from draftlab.methods.specbound.module import layer_states
    from draftlab.stages.data import run_data_stage

    spec = MethodSpec(cfg.method)
    data = run_data_stage(cfg, spec, target)
    dm = spec.build_datamodule(data.samples, features=None, pad_token_id=target.tokenizer.pad_token_id or 0,
                               seed=int(cfg.seed))
    dm.setup("fit")
    L = target.geometry.num_layers
    batches = []
    for b, batch in enumerate(dm.val_dataloader()):
        if max_batches is not None and b >= max_batches:
            break
        states, final = layer_states(target, batch["input_ids"], heads.exit_layers)
        B, T, d = final.shape
        conf = {layer: {a: torch.empty(B * T) for a in alphas} for layer in heads.exit_layers}
        agree = {layer: torch.empty(B * T, dtype=torch.bool) for layer in heads.exit_layers}
        for s in range(0, B * T, CHUNK):
            want = target.lm_head(final.reshape(-1, d)[s:s + CHUNK][None]).float()[0].argmax(-1)  # [c]
            for layer in heads.exit_layers:
                z = heads.logits(target, states[layer].reshape(-1, d)[s:s + CHUNK][None], layer).float()[0]
                agree[layer][s:s + CHUNK] = z.argmax(-1) == want
                for a in alphas:
                    conf[layer][a][s:s + CHUNK] = torch.softmax(z / act_temperature(layer, L, a), -1).max(-1).values
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, T]
        batches.append(({k: {a: v.view(B, T) for a, v in c.items()} for k, c in conf.items()},
                        {k: v.view(B, T) for k, v in agree.items()}, valid))
    return batches


def simulate(batches, *, alpha: float, tau: float, d_max: int, w_max: int) -> dict:
    from draftlab.methods.specbound.module import chain_lengths, first_exit

    n = exits = layers = right = chain = 0.0
    for conf, agree, valid in batches:
        exited, layer_of, ok = first_exit({k: c[alpha] for k, c in conf.items()}, agree, tau, d_max)
        exited, ok = exited & valid, ok & valid
        n += float(valid.sum())
        exits += float(exited.sum())
        layers += float((layer_of * exited).sum())
        right += float(ok.sum())
        chain += float(chain_lengths(ok, valid, w_max)[valid].sum())
    return {"exit_rate": exits / max(n, 1.0), "mean_exit_layer": layers / max(exits, 1.0),
            "precision": right / max(exits, 1.0), "simulated_tau": 1.0 + chain / max(n, 1.0)}


@torch.no_grad()
def partial_costs(target, heads, *, context: int = 256, reps: int = 15) -> tuple[dict[int, float], float, float]:
    """Median seconds of one token through layers [0, l) per exit layer, of one exit check (head map, final
    norm, LM head and max softmax over the vocabulary) and of one full AR step, interleaved."""
    from draftlab.decoding.cost import time_interleaved

    cache = target.new_cache(1, context + 2)
    prompt = (torch.arange(context) * 7919 % (target.geometry.vocab_size - 1) + 1)[None]
    target.forward(prompt, cache=cache)
    cache.commit(context)
    slot = torch.tensor([context])
    mask = torch.ones(1, context + 1, dtype=torch.bool)
    tok = torch.tensor([[42]])
    h0 = target.embed(tok)
    first = heads.exit_layers[0]

    def layers(upto):
        return lambda: target.forward_layers(h0, 0, upto, position_ids=slot, cache=cache, attn_mask=mask, slots=slot)

    calls = [layers(layer) for layer in heads.exit_layers]
    calls.append(lambda: heads.logits(target, h0, first).softmax(-1).max())
    calls.append(lambda: target.forward(tok, slot, cache, mask))
    times = time_interleaved(calls, reps)
    return dict(zip(heads.exit_layers, times[:-2])), times[-2], times[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run directory or record.json of draftlab-train")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0])
    ap.add_argument("--taus", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--d-max", type=int, nargs="+", default=None, help="default: every exit layer")
    ap.add_argument("--w-max", type=int, default=6)
    ap.add_argument("--max-batches", type=int, default=None)
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from draftlab.methods.registry import MethodSpec

    rec = training_record(args.run)
    cfg = OmegaConf.create(rec.data["config"])
    from hydra.utils import instantiate

    target = instantiate(cfg.target)
    heads = MethodSpec(cfg.method).load(Path(rec.data["artifacts"]["draft"]), target).eval()
    d_maxes = args.d_max or list(heads.exit_layers)
    t0 = time.perf_counter()
    batches = held_out_scores(cfg, heads, target, args.alphas, args.max_batches)
    n = sum(int(v.sum()) for _, _, v in batches)
    seconds = time.perf_counter() - t0
    grid = []
    curves: dict[tuple, list[float]] = {}
    best = None
    for alpha in args.alphas:
        for d_max in d_maxes:
            for tau in args.taus:
                m = simulate(batches, alpha=alpha, tau=tau, d_max=d_max, w_max=args.w_max)
                curves.setdefault((alpha, d_max), []).append(m["simulated_tau"])
                grid.append([f"{alpha:g}", f"{tau:g}", d_max, f"{m['exit_rate']:.3f}", f"{m['mean_exit_layer']:.1f}",
                             f"{m['precision']:.3f}", f"{m['simulated_tau']:.3f}"])
                if best is None or m["simulated_tau"] > best[0]:
                    best = (m["simulated_tau"], alpha, tau, d_max)
    lines = [f"## (a) Exit policy on {n:,} held-out positions (w_max {args.w_max}; {seconds:.0f} s)", "",
             *markdown_table(["alpha", "tau", "d_max", "exit rate", "mean exit layer", "precision",
                              "simulated tokens/round"], grid, "r" * 7)]
    lines += ["", f"Highest simulated tokens per round: {best[0]:.3f} at alpha {best[1]:g}, tau {best[2]:g}, "
              f"d_max {best[3]}.", ""]
    layer_s, check_s, step_s = partial_costs(target, heads)
    L = target.geometry.num_layers
    lines += [f"## (b) Cost of one drafted token against a full AR step ({step_s * 1000:.1f} ms)", "",
              f"One exit check (W_l, final norm, LM head over {target.geometry.vocab_size:,} tokens, max softmax): "
              f"{check_s * 1000:.1f} ms = {check_s / step_s:.2f} AR steps. A token exiting at layer l has run "
              "layers [0, l) and one check at every head up to l.", ""]
    # A token exiting at the i-th head ran the layers before it and i + 1 exit checks.
    costs = [[f"{layer} of {L}", f"{s * 1000:.1f}", i + 1, f"{(s + (i + 1) * check_s) / step_s:.2f}"]
             for i, (layer, s) in enumerate(layer_s.items())]
    lines += markdown_table(["exit layer", "layers [0, l) ms", "+ checks", "AR steps"], costs, "rrrr")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (alpha, d_max), ys in curves.items():
        ax.plot(args.taus, ys, marker="o", label=f"alpha {alpha:g}, d_max {d_max}")
    ax.set_xlabel("tau (exit threshold)")
    ax.set_ylabel("simulated tokens per round")
    ax.set_title("SpecBound exit policy on held-out text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
