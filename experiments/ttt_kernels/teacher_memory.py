"""Peak memory of the TTT teacher, whole vs built in row chunks (``methods/eagle3/ttt.py``, ``_TargetSide``).

    python experiments/ttt_kernels/teacher_memory.py --out experiments/ttt_kernels/table_teacher.md

The teacher turns the target's logits ``[B, T, V]`` (bf16, as a bf16 target returns them; a random LM head over
random states) into the draft-vocabulary targets. Whole, it makes fp32 ``[B, T, V]`` copies and temporaries;
chunked, one chunk of rows at a time. Each case runs in a fresh process and reports the rise of its peak
resident memory over the logits it starts from (``ru_maxrss``), so the two paths are measured side by side in
one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = [(49152, 8192), (128256, 32000)]  # SmolLM2-sized and Llama-3-sized vocabularies, their usual V_d


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _one(path: str, vocab: int, draft_vocab: int, batch: int, tokens: int) -> dict:
    import torch

    from draftlab.methods.eagle3.ttt import _TargetSide

    torch.manual_seed(0)
    head = torch.randn(vocab, 256, dtype=torch.bfloat16)  # a random LM head over 256-d states
    logits = torch.empty(batch, tokens, vocab, dtype=torch.bfloat16)
    for b in range(batch):  # built row block by row block: no fp32 temporary of the whole size
        logits[b] = torch.randn(tokens, 256, dtype=torch.bfloat16) @ head.T

    class Draft:  # what the teacher reads of a draft: its vocabulary mapping
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
        t2d = torch.zeros(vocab, dtype=torch.bool)

    Draft.t2d[:draft_vocab] = True
    before = _peak_mib()
    t0 = time.perf_counter()
    if path == "whole":
        # The teacher as draftlab computed it before the chunks (tests/methods/test_eagle3_ttt.py keeps the same
        # reference): the logits in fp32, every quantity over [B, T, V].
        z = logits.to(torch.float32)
        z_d = z.index_select(-1, Draft.d2t + torch.arange(draft_vocab))
        lse_d = torch.logsumexp(z_d, dim=-1, keepdim=True)
        p = torch.exp(z_d - lse_d)
        p_full = torch.exp(z_d - torch.logsumexp(z, dim=-1, keepdim=True))
        in_draft, argmax = Draft.t2d[z.argmax(-1)].float(), z_d.argmax(-1)
        del z, z_d, p, p_full, in_draft, argmax
    else:
        _TargetSide.of(Draft, logits)
    return {"path": path, "V": vocab, "V_d": draft_vocab, "B": batch, "T": tokens,
            "logits_mib": logits.numel() * 2 / 2**20, "peak_rise_mib": _peak_mib() - before,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", nargs=3, default=None, help=argparse.SUPPRESS)  # path V V_d: one child process
    args = ap.parse_args()
    if args.case:
        path, v, vd = args.case
        print(json.dumps(_one(path, int(v), int(vd), args.batch, args.tokens)))
        return
    rows = []
    for vocab, draft_vocab in CASES:
        got = {}
        for path in ("whole", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--batch", str(args.batch), "--tokens", str(args.tokens),
                                  "--case", path, str(vocab), str(draft_vocab)], check=True, capture_output=True, text=True)
            got[path] = json.loads(out.stdout.strip().splitlines()[-1])
        w, c = got["whole"], got["chunked"]
        rows.append(f"| {vocab:,} | {draft_vocab:,} | {w['logits_mib']:.0f} | {w['peak_rise_mib']:.0f} | "
                    f"{c['peak_rise_mib']:.0f} | {c['peak_rise_mib'] / w['peak_rise_mib']:.3f} | "
                    f"{w['seconds']:.2f} | {c['seconds']:.2f} |")
    table = "\n".join([
        f"Teacher peak memory, B = {args.batch}, T = {args.tokens}, bf16 logits (peak resident memory above the "
        "logits, one fresh process per case):", "",
        "| V | V_d | logits (MiB) | whole: peak rise (MiB) | chunked: peak rise (MiB) | chunked / whole | "
        "whole (s) | chunked (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, ""])
    print(table)
    if args.out:
        from draftlab.utils.atomic import atomic_write_text

        atomic_write_text(Path(args.out), table)


if __name__ == "__main__":
    main()
