"""Run inside vLLM's environment: the hidden states of chosen layers for given token-id sequences.

    python extract_hidden_states.py --model DIR --layers 3,15,27,30 --requests REQ.jsonl --out DIR

``REQ.jsonl`` holds one ``{"index": i, "token_ids": [...]}`` per line; for each, ``<out>/<index:07d>.safetensors``
gets ``hidden_states [T, n_layers, d]`` (vLLM's layer id L is the residual stream entering layer L, i.e. HF
``hidden_states[L]``; id ``num_layers`` is the final residual before the model's norm) and ``token_ids [T]``.
It uses vLLM's ``extract_hidden_states`` speculative method (a prefill, one token generated and dropped) with
a connector that writes each request's rows to disk. Files already there are skipped, each file is written
under a temporary name and renamed, so an interrupted run resumes. Imports vLLM, never draftlab.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--layers", required=True, help="comma-separated vLLM layer ids")
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--connector", choices=("cpu", "stock"), default="cpu",
                   help="cpu: this directory's CpuHiddenStatesConnector; stock: vLLM's ExampleHiddenStatesConnector (GPU)")
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    with open(a.requests) as f:
        for line in f:
            req = json.loads(line)
            if not (out / f"{int(req['index']):07d}.safetensors").exists():
                todo.append(req)
    print(f"extract: {len(todo)} sequences to do", flush=True)
    if not todo:
        return 0
    layers = [int(x) for x in a.layers.split(",")]
    scratch = tempfile.mkdtemp(prefix="hs_", dir=out)
    connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": scratch}}
    if a.connector == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        connector |= {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "cpu_hidden_states_connector"}
    start = time.time()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, enforce_eager=a.enforce_eager,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
              kv_transfer_config=connector)
    print(f"extract: engine up in {time.time() - start:.1f} s", flush=True)
    start = time.time()
    outputs = llm.generate([{"prompt_token_ids": list(r["token_ids"])} for r in todo], SamplingParams(max_tokens=1))
    tokens = 0
    for req, o in zip(todo, outputs):
        data = load_hidden_states(o.kv_transfer_params["hidden_states_path"])
        n = len(req["token_ids"])
        if data["hidden_states"].shape[0] < n or data["token_ids"][:n].tolist() != list(req["token_ids"]):
            raise RuntimeError(f"sequence {req['index']}: the engine returned rows for other tokens")
        path = out / f"{int(req['index']):07d}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"hidden_states": data["hidden_states"][:n].contiguous(), "token_ids": data["token_ids"][:n]}, str(tmp))
        os.replace(tmp, path)
        tokens += n
    shutil.rmtree(scratch, ignore_errors=True)
    secs = time.time() - start
    print(f"extract: {len(todo)} sequences, {tokens} tokens in {secs:.1f} s ({tokens / max(secs, 1e-9):.1f} tok/s)",
          flush=True)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the entry point must be guarded
    raise SystemExit(main())
