"""Target features through vLLM (``draftlab.serving.hidden_states``): the layer-id mapping, the store it writes
against ``precompute_features``' on the tiny target (the engine's rows stood in by HF's, taken at the ids vLLM
uses), resuming, and an opt-in run of the real engine on SmolLM2 (marker ``serving``)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab.data.features import precompute_features
from draftlab.data.template import RenderedSample
from draftlab.serving import hidden_states as hs


def _samples(n: int, seed: int = 0) -> list[RenderedSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randint(100, 5000) for _ in range(rng.randint(5, 14))]
        out.append(RenderedSample(input_ids=ids, loss_mask=[1] * len(ids), id=f"s{i}"))
    return out


def test_taps_map_onto_vllm_ids_by_convention():
    # output_of L is HF hidden_states[L + 1]; input_to L is hidden_states[L]; the final residual comes last
    assert hs.vllm_layer_ids([1, 14, 26], "output_of", 30) == [2, 15, 27, 30]
    assert hs.vllm_layer_ids([2, 15, 27], "input_to", 30) == [2, 15, 27, 30]


@torch.no_grad()
def _engine_rows(target, ids: list[int], layers: list[int]) -> torch.Tensor:
    """What vLLM returns for ``ids``: the residual entering each layer id, the last id the final pre-norm one."""
    model, grabbed = target.model, {}
    decoder = model.get_decoder()
    hook = decoder.layers[-1].register_forward_hook(lambda m, a, out: grabbed.setdefault("pre_norm", out[0] if
                                                                                         isinstance(out, tuple) else out))
    try:
        out = model(torch.tensor([ids], device=target.device), output_hidden_states=True)
    finally:
        hook.remove()
    n_layers = len(decoder.layers)  # HF's hidden_states[n_layers] is post-norm; vLLM's id n_layers is not
    pre_norm = grabbed["pre_norm"].reshape(len(ids), -1)
    states = [pre_norm if i == n_layers else out.hidden_states[i][0] for i in layers]
    return torch.stack(states, dim=1).float().cpu()  # [T, n, d]


def _fake_engine(target, calls):
    def run(python, model, layers, sequences, out, **kw):
        calls.append(sorted(sequences))
        out.mkdir(parents=True, exist_ok=True)
        for i, ids in sequences.items():
            save_file({"hidden_states": _engine_rows(target, ids, layers), "token_ids": torch.tensor(ids)},
                      str(out / f"{i:07d}.safetensors"))
    return run


def test_the_store_equals_precompute_features_and_resumes(tiny_target, tmp_path, monkeypatch):
    samples = _samples(5)
    taps = tiny_target.aux_layer_ids if hasattr(tiny_target, "aux_layer_ids") else [0, 1]
    ref = precompute_features(tiny_target, samples, tmp_path / "hf", aux_layer_ids=taps)
    calls = []
    monkeypatch.setattr(hs, "run_engine", _fake_engine(tiny_target, calls))
    got = hs.vllm_feature_store(tiny_target, samples, tmp_path / "vllm", aux_layer_ids=taps, python="py", model="m")
    assert calls == [[0, 1, 2, 3, 4]]
    for i in range(len(samples)):
        a, b = load_file(str(ref / f"{i:07d}.safetensors")), load_file(str(got / f"{i:07d}.safetensors"))
        assert a.keys() == b.keys() and a["aux"].shape == b["aux"].shape
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-4)  # batched vs one at a time
    # a complete store is not asked again; a lost sample is the only one asked again
    hs.vllm_feature_store(tiny_target, samples, got, aux_layer_ids=taps, python="py", model="m")
    assert len(calls) == 1
    (got / "complete.json").unlink()
    (got / "0000003.safetensors").unlink()
    hs.vllm_feature_store(tiny_target, samples, got, aux_layer_ids=taps, python="py", model="m")
    assert calls[-1] == [3] and (got / "complete.json").exists()


def test_rows_of_other_tokens_are_refused(tiny_target, tmp_path, monkeypatch):
    samples = _samples(2, seed=1)

    def wrong(python, model, layers, sequences, out, **kw):
        _fake_engine(tiny_target, [])(python, model, layers, {i: ids[::-1] for i, ids in sequences.items()}, out)

    monkeypatch.setattr(hs, "run_engine", wrong)
    with pytest.raises(RuntimeError, match="other tokens"):
        hs.vllm_feature_store(tiny_target, samples, tmp_path / "v", aux_layer_ids=[0], python="py", model="m")
    assert not (tmp_path / "v" / "complete.json").exists()


VLLM_PYTHON = os.environ.get("DRAFTLAB_VLLM_PYTHON", "")


@pytest.mark.serving
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
                    reason="no vLLM environment: set DRAFTLAB_VLLM_PYTHON to its python")
def test_vllm_features_equal_the_hf_targets_at_fp32(smollm2, tmp_path):
    """One vLLM start (about a minute on CPU, eager); 4 samples of SmolLM2-135M at fp32 against the HF target."""
    samples = _samples(4, seed=2)
    taps = [1, 14, 26]  # EAGLE-3's default taps of a 30-layer target, output_of
    ref = precompute_features(smollm2, samples, tmp_path / "hf", aux_layer_ids=taps)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    got = hs.vllm_feature_store(smollm2, samples, tmp_path / "vllm", aux_layer_ids=taps, python=VLLM_PYTHON,
                                env=env, extra=["--enforce-eager"])
    worst = 0.0
    for i in range(len(samples)):
        a, b = load_file(str(ref / f"{i:07d}.safetensors")), load_file(str(got / f"{i:07d}.safetensors"))
        for key in ("aux", "last"):
            scale = a[key].abs().max().item()
            err = (a[key] - b[key]).abs().max().item()
            worst = max(worst, err / scale)
            assert err <= 1e-4 * scale, f"sample {i} {key}: max |vllm - hf| {err:.3g} at scale {scale:.3g}"
    print(f"vLLM vs HF features, fp32: worst max-abs error / max-abs value = {worst:.2e}")
    assert Path(got / "complete.json").exists()


def test_a_method_features_entry_can_name_the_vllm_store(tiny_target, tmp_path, monkeypatch):
    """The method seam: ``method.features._target_`` swapped to the vLLM store, keyed apart from HF's."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from draftlab.data.features import offline_features

    class Draft:
        def taps(self, target):
            return [0, 1]

    calls = []
    monkeypatch.setattr(hs, "run_engine", _fake_engine(tiny_target, calls))
    block = OmegaConf.create({"_target_": "draftlab.serving.hidden_states.vllm_offline_features", "_partial_": True,
                              "dtype": "float32", "python": "py", "model": "m"})
    samples, key = _samples(3, seed=3), ("tiny", "data")
    got = instantiate(block)(target=tiny_target, draft=Draft(), samples=samples, root=tmp_path, key=key)
    ref = offline_features(target=tiny_target, draft=Draft(), samples=samples, root=tmp_path, key=key)
    assert got != ref and got.parent == ref.parent and calls == [[0, 1, 2]]
    torch.testing.assert_close(load_file(str(got / "0000001.safetensors"))["aux"],
                               load_file(str(ref / "0000001.safetensors"))["aux"], rtol=1e-4, atol=1e-4)
