"""DFlash2 (``methods/dflash2``): the block convolutions, the selector's walk and law, training, the export.

The sampled walk is checked where it can fail: a stand-in draft whose slot logits are the target's own (so
the first slot is accepted in most rounds) with a selector whose edges are switched on, through the powered
first-round check, which kills a walk that reports its law before the temperature. Margins at 300 trials
(one run; ``pytest -s -n 0 tests/methods/test_dflash2.py -k "walk or temperature"`` prints them): the real
walk's largest |z| 1.70 (p = 1.0, 264 of 300 first rounds accepted); the mutant's rank bins give x2 = 34.5,
largest |z| 4.80 (p = 7.5e-5, past the 1e-4 floor of the check).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.dflash2 import DFlash2Drafter
from draftlab.methods.dflash2.model import BlockConv
from draftlab.methods.dflash2.module import DFlash2Module
from tests.decoding.conformance.checks import check_first_round_law
from tests.decoding.conformance.methods import first_round_prompt, quick_train, spec
from tests.methods.corpus import TRAIN_PROMPTS

GREEDY = GenerationConfig(max_new_tokens=24, temperature=0.0)


def _greedy(target, drafter) -> list[int]:
    prompt = list(TRAIN_PROMPTS[0])
    out, _ = speculative_generate(target, prompt, drafter, GREEDY)
    return out


@pytest.fixture(scope="module")
def dflash_draft(tiny_target):
    return quick_train(spec("dflash"), tiny_target)


@pytest.fixture(scope="module")
def from_dflash(tiny_target, dflash_draft, tmp_path_factory):
    """A fresh DFlash2 draft whose backbone is the quickly trained DFlash draft (``init.from``)."""
    path = spec("dflash").save(dflash_draft, tmp_path_factory.mktemp("dflash") / "draft", tiny_target)
    s = copy.deepcopy(spec("dflash2"))
    OmegaConf.update(s.cfg, "draft.init.from", str(path))
    return s.build_draft(tiny_target)


# ---- the draft -------------------------------------------------------------------------------------------

def test_block_conv_is_the_formula_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = BlockConv(8, taps=3, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 10, 8)  # two blocks of 5
    delta = conv.deltas(x)  # [1, 10, 2, 3, 2]
    out = conv.convolve(x, delta, 1, block_size=5)
    want = torch.zeros_like(x)
    for t in range(10):
        for c in range(8):
            for j in range(3):
                if t % 5 >= j:
                    want[0, t, c] += (conv.base_kernel[1, j, c] + delta[0, t, 1, j, c // 4]) * x[0, t - j, c]
    torch.testing.assert_close(out, want)
    moved = x.clone()
    moved[0, 4] += 1.0  # the last row of block 0: block 1 must not see it
    torch.testing.assert_close(conv.convolve(moved, delta, 1, 5)[0, 5:], out[0, 5:])


def test_a_fresh_dflash2_decodes_exactly_as_its_dflash(tiny_target, dflash_draft, from_dflash):
    dflash = spec("dflash").build_drafter(dflash_draft)
    dflash.sampling = "argmax"
    want = _greedy(tiny_target, dflash)
    assert _greedy(tiny_target, spec("dflash2").build_drafter(from_dflash)) == want
    ar, _ = autoregressive_generate(tiny_target, list(TRAIN_PROMPTS[0]), GREEDY)
    assert want == ar


def test_greedy_equals_ar_with_the_selector_switched_on(tiny_target, from_dflash):
    draft = copy.deepcopy(from_dflash)
    with torch.no_grad():
        torch.manual_seed(1)
        draft.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
        for layer in draft.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0, 0.05)
    prompt = list(TRAIN_PROMPTS[0])
    ar, _ = autoregressive_generate(tiny_target, prompt, GREEDY)
    out, stats = speculative_generate(tiny_target, prompt, DFlash2Drafter(draft), GREEDY)
    assert out == ar


def test_the_selector_reranks_by_the_previous_token(tiny_target, from_dflash):
    draft = copy.deepcopy(from_dflash)
    sel = draft.candidate_selector
    with torch.no_grad():
        sel.hidden_projection.weight.normal_(0, 1.0)
    hidden = torch.randn(3, draft.config.hidden_size)
    logits = torch.zeros(3, draft.config.vocab_size)
    logits[:, :16] = torch.linspace(0.2, 0.0, 16)  # nearly flat unary candidates: the edge decides
    state = type("S", (), {"root": 5, "temperature": 0.0, "generator": None})()
    drafter = DFlash2Drafter(draft)
    tokens, probs = drafter.walk(state, hidden, logits, greedy=True)
    assert probs is None and tokens.shape == (3,)
    values, ids = draft.candidates(logits)
    prev = torch.tensor([5])
    for t in range(3):  # each pick is the argmax of unary + edge with the pick before it
        score = values[t] + sel.edges(prev, ids[t], sel.project(hidden[t]))[0]
        assert int(tokens[t]) == int(ids[t, score.argmax()])
        prev = tokens[t : t + 1]
    assert tokens.tolist() != logits.argmax(-1).tolist()  # the unary chain would be [0, 0, 0]


# ---- the sampled walk: a stand-in draft the target accepts, and a mutant ---------------------------------

TEMPERATURE, TRIALS = 0.3, 300


class InformedWalk(DFlash2Drafter):
    """Slot logits = the target's next-token logits after the root (+ fixed noise per slot); the selector's
    edges are on, so the walk's law is not the unary one."""

    def propose(self, state):
        self._seq, self._target = state.tokens, state.target
        return super().propose(state)

    def _block_pass(self, inputs):
        hidden, _ = super()._block_pass(inputs)
        with torch.no_grad():
            base = self._target.forward(torch.tensor([self._seq])).logits[0, -1]  # [V]
        return hidden, (base[None] + self.noise)[: self.block_size - 1]


class UntemperedLaw(InformedWalk):
    """Draws at the temperature, reports each slot's law before it: softmax(score), not softmax(score / T)."""

    def walk(self, state, hidden, logits, *, greedy):
        tokens, rows = super().walk(state, hidden, logits, greedy=greedy)
        if rows is None:
            return tokens, rows
        values, ids = self.draft.candidates(logits)
        sel = self.draft.candidate_selector
        prev = torch.cat([torch.tensor([int(state.root)]), tokens[:-1]])
        for t in range(len(tokens)):
            score = values[t] + sel.edges(prev[t : t + 1], ids[t], sel.project(hidden[t]))[0]
            rows[t] = torch.zeros_like(rows[t]).scatter_(0, ids[t], torch.softmax(score, -1).to(rows.dtype))
        return tokens, rows


@pytest.fixture(scope="module")
def informed(tiny_target, from_dflash):
    draft = copy.deepcopy(from_dflash)
    with torch.no_grad():
        torch.manual_seed(2)
        draft.candidate_selector.hidden_projection.weight.normal_(0, 0.05)
        noise = torch.randn(draft.config.block_size, tiny_target.geometry.vocab_size) * 0.05

    def factory(cls):
        def make():
            drafter = cls(draft, block_size=3)
            drafter.noise = noise[:2]
            return drafter
        return make
    return factory


def test_the_sampled_walk_follows_the_target(tiny_target, informed):
    result = check_first_round_law(tiny_target, informed(InformedWalk), first_round_prompt(tiny_target),
                                   temperature=TEMPERATURE, trials=TRIALS)
    print(f"real walk: max |z| {result['max_z']:.2f}, p {result['p']:.3f}, accepted {result['accepted']}/{TRIALS}")
    assert result["accepted"] > TRIALS / 5, f"the stand-in is accepted too rarely to give power: {result}"


def test_a_law_reported_before_the_temperature_is_caught(tiny_target, informed):
    with pytest.raises(AssertionError, match="do not follow the target") as caught:
        check_first_round_law(tiny_target, informed(UntemperedLaw), first_round_prompt(tiny_target),
                              temperature=TEMPERATURE, trials=TRIALS)
    print(f"mutant: {str(caught.value)[:400]}")  # the margin (pytest -s)


# ---- training --------------------------------------------------------------------------------------------

def test_the_selector_weight_warms_up_then_ramps(from_dflash):
    m = DFlash2Module(from_dflash, selector_weight=2.0, selector_warmup_steps=3, selector_ramp_steps=4)
    assert [m.selector_weight_at(s) for s in range(9)] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0]


def test_training_lowers_the_selector_loss_and_logs_its_metrics(tiny_target, from_dflash):
    from tests.decoding.conformance.methods import sequences

    draft = copy.deepcopy(from_dflash).train()
    m = DFlash2Module(draft, tiny_target, num_anchors=8, selector_weight=1.0)
    seq = torch.tensor([sequences(tiny_target)[0]])
    batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": torch.ones_like(seq)}
    frozen = {k: v.clone() for k, v in draft.state_dict().items() if "candidate_selector" not in k}
    opt = torch.optim.Adam([p for p in draft.candidate_selector.parameters()], lr=3e-3)
    losses = []
    for _ in range(25):
        m.block_step(batch, torch.Generator().manual_seed(0))  # the same blocks every step
        loss = m._selector.loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    s = m._selector.sums
    assert 0 < s["top_k_hits"].sum() <= s["labelled"].sum() and s["picked"].sum() <= s["top_k_hits"].sum()
    # selector_detach: the backbone has no gradient from the selector loss
    assert all(p.grad is None for n, p in draft.named_parameters() if "candidate_selector" not in n)
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in frozen.items())


# ---- the export ------------------------------------------------------------------------------------------

VLLM_DFLASH_CONFIG = ("mask_token_id", "target_layer_ids", "block_size", "conv_kernel_size", "conv_group_size",
                      "selector_rank", "selector_top_k")  # what qwen3_dflash2.py / its speculator read


def test_export_round_trips_with_the_fields_and_names_vllm_reads(tiny_target, from_dflash, tmp_path):
    from safetensors import safe_open

    s = spec("dflash2")
    out = s.export("dflash2", from_dflash, tmp_path / "d2", target=tiny_target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and set(VLLM_DFLASH_CONFIG) <= set(cfg["dflash_config"])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    c = from_dflash.config
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    for i in range(c.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            assert {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert s.validate_export("dflash2", out, target=tiny_target) == []
    back = s.load(out, tiny_target)
    assert all(torch.equal(a, b) for a, b in zip(from_dflash.state_dict().values(), back.state_dict().values()))


def test_validate_names_a_missing_selector_tensor_and_a_missing_field(tiny_target, from_dflash, tmp_path):
    from safetensors.torch import load_file, save_file

    s = spec("dflash2")
    out = s.export("dflash2", from_dflash, tmp_path / "d2", target=tiny_target)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, str(out / "model.safetensors"))
    problems = s.validate_export("dflash2", out)
    assert any("missing tensor 'candidate_selector.successor_codebook'" in p for p in problems), problems
    cfg = json.loads((out / "config.json").read_text())
    del cfg["draftlab"]
    del cfg["dflash_config"]["selector_top_k"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("selector_top_k" in p for p in s.validate_export("dflash2", out)), s.validate_export("dflash2", out)
