"""Training steps under GPU conditions, on the CPU: an fp32 draft under bf16 autocast (what ``trainer=gpu`` /
``trainer=fsdp`` train with: ``precision: bf16-mixed``), with each TTT attention and soft cross-entropy
choice, Triton under its interpreter. Each step must run, and its gradients must stay within bf16's reach of
the same step in fp32."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from draftlab.data.template import RenderedSample  # noqa: E402
from draftlab.kernels._triton import triton  # noqa: E402
from draftlab.methods.registry import MethodSpec  # noqa: E402
from tests.decoding.conformance.methods import on_device, sequences, vocab_for  # noqa: E402
from tests.methods.corpus import TRAIN_PROMPTS  # noqa: E402

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed (pip install -e '.[kernels]')")


def _step(target, name: str, overrides: list[str], autocast: bool) -> tuple[float, torch.Tensor]:
    """One training step's loss and flattened gradient of a freshly built, seeded draft."""
    spec = MethodSpec.from_name(name, overrides, ci=True)
    seqs = sequences(target)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draft = spec.build_draft(target, vocab_for(spec, target, seqs))
        samples = [RenderedSample(input_ids=s, loss_mask=[0] * (len(p) - 1) + [1] * (len(s) - len(p) + 1),
                                  id=f"{i}-{c}") for c in range(2) for i, (p, s) in enumerate(zip(TRAIN_PROMPTS, seqs))]
        module = spec.build_module(draft, target)
        dm = spec.build_datamodule(samples, features=None, pad_token_id=target.tokenizer.pad_token_id or 0, seed=0)
        dm.setup("fit")
        batch = on_device(next(iter(dm.train_dataloader())), target.device)
        draft.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = module.training_step(batch, 0)
        loss.backward()
    grads = [p.grad.flatten().double() for p in draft.parameters() if p.requires_grad and p.grad is not None]
    assert grads, "no gradient reached the draft"
    return float(loss), torch.cat(grads)


# (method, overrides): every attention and cross-entropy choice of EAGLE-3's module, ConFu's (an EAGLE-3
# module with contemplate rows; its future keys need the torch attention) with the Triton cross-entropy, and
# DFlash's block loss.
CASES = {
    "eagle3-torch": ("eagle3", ["method.module.attention=torch", "method.module.cross_entropy=torch"]),
    "eagle3-blockwise": ("eagle3", ["method.module.attention=blockwise", "method.module.cross_entropy=chunked"]),
    "eagle3-triton": ("eagle3", ["method.module.attention=triton", "method.module.cross_entropy=triton"]),
    "confu-triton_ce": ("confu", ["method.module.attention=torch", "method.module.cross_entropy=triton"]),
    "dflash": ("dflash", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bf16_autocast_step_runs_and_stays_near_fp32(tiny_target, case):
    name, overrides = CASES[case]
    if any("triton" in o for o in overrides) and triton is None:
        pytest.skip("triton is not installed")
    loss32, g32 = _step(tiny_target, name, overrides, autocast=False)
    loss16, g16 = _step(tiny_target, name, overrides, autocast=True)
    assert torch.isfinite(g16).all() and abs(loss16 - loss32) <= 0.02 * abs(loss32) + 1e-3, (loss16, loss32)
    rel = float((g16 - g32).norm() / g32.norm())
    assert rel < 0.1, f"{case}: gradient under bf16 autocast is {rel:.3g} (relative) from fp32"
