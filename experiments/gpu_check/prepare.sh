#!/usr/bin/env bash
# Builds the folder the GPU check carries to a machine with no network (default: .gpu_check/, ignored by git):
#   wheels/      the project's dependencies a bare CUDA image lacks (Hydra, OmegaConf, ANTLR runtime),
#   tokenizer/   the SmolLM2 tokenizer files (no model weights: every target in the check has random weights),
#   shared_data/ a slice of ../shared/data: 64 ShareGPT conversations and 8 MT-bench questions.
# About 4 MiB in all. Usage: bash experiments/gpu_check/prepare.sh [DEST]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/.gpu_check}
shared=${DRAFTLAB_SHARED_DATA:-$root/../shared/data}
python=${PYTHON:-python}

rm -rf "$dest"
mkdir -p "$dest/wheels" "$dest/tokenizer" "$dest/shared_data/conversations" "$dest/shared_data/mt_bench"
# Pure-Python wheels, so they install on whatever Python the GPU image has. ANTLR's runtime ships only as an
# sdist on PyPI: pip builds its wheel here.
"$python" -m pip wheel -q --no-deps -w "$dest/wheels" "hydra-core==1.3.2" "omegaconf==2.3.0" \
  "antlr4-python3-runtime==4.9.3"
"$python" - "$dest/tokenizer" <<'EOF'
import shutil, sys
from pathlib import Path
from draftlab.assets import fetch

src = Path(fetch("smollm2-135m-instruct"))
for f in src.iterdir():
    if f.is_file() and ("token" in f.name or f.name in {"chat_template.jinja", "special_tokens_map.json"}):
        shutil.copy(f, sys.argv[1])
EOF
head -n 64 "$shared/conversations/sharegpt_v3_first5000.jsonl" > "$dest/shared_data/conversations/sharegpt_v3_first5000.jsonl"
head -n 8 "$shared/mt_bench/question.jsonl" > "$dest/shared_data/mt_bench/question.jsonl"
du -sh "$dest"
