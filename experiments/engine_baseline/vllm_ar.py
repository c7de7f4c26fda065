"""vLLM's offline engine decoding token-id prompts greedily, for ``bench.py --parts f --vllm-python``.

Runs under the vLLM environment's interpreter (vLLM is not a draftlab dependency; see
experiments/serving/install_vllm_cpu.sh):

    <vllm-venv>/bin/python experiments/engine_baseline/vllm_ar.py --model DIR --prompts ids.json --out out.json

Each prompt is generated alone (batch 1, ``ignore_eos``, exactly ``--new-tokens`` tokens) after one warm-up
generation; the output holds per-prompt tokens/s (wall time of the ``generate`` call, prefill included, as
draftlab's AR numbers are) and the tokens, so the caller can compare outputs with its own.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the target's HF directory")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(args.prompts).read())
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    tok_s, tokens = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
        dt = time.perf_counter() - t0
        tok_s.append(len(out.token_ids) / dt)
        tokens.append(list(out.token_ids))
    with open(args.out, "w") as f:
        json.dump({"tok_s": tok_s, "tokens": tokens, "dtype": args.dtype}, f)


if __name__ == "__main__":
    main()
