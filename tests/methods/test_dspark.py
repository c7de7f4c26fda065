"""DSpark: training, the vLLM export, greedy losslessness, and the law each sampled slot is drawn from."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from draftlab.decoding.budget import TreeBudget
from draftlab.decoding.cost import VerifyCost
from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.methods.dflash import DFlashDrafter
from draftlab.methods.dflash import build_draft as build_dflash
from draftlab.methods.dflash import save_artifact as save_dflash
from draftlab.methods.dflash.blocks import block_logits, make_blocks
from draftlab.methods.dspark import DSparkDrafter, build_draft, load_artifact, save_artifact
from draftlab.methods.dspark.export import validate
from draftlab.methods.dspark.module import DSparkModule
from draftlab.targets.base import PassRequest
from tests.decoding.conformance.checks import check_first_round_law
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT, train_sequences

BS, RANK = 4, 8
SIZES = dict(num_layers=1, block_size=BS, markov_rank=RANK)
N_DRAWS = 300  # draws of the first two slots from one state
MUTANT_DRAWS = 60  # a slip draws ~85 % of its tokens where the law it reports has no mass
FIRST_ROUND_TRIALS = 100  # check_first_round_law: the slip's drafted tokens land at the Monte-Carlo floor


def _aux(target, draft, ids):
    return target.forward(ids, request=PassRequest(aux=draft.taps(target), logits_rows=torch.arange(0))).aux_hidden


@pytest.fixture(scope="module")
def trained(tiny_target):
    """A DSpark draft trained by ``DSparkModule`` (offline features) on the target's continuation of one prompt."""
    seq, prompt = train_sequences(tiny_target)[0], TRAIN_PROMPTS[0]
    ids = torch.tensor([seq])  # [1, T]
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, len(prompt):] = 1
    draft = build_draft(tiny_target, seed=0, **SIZES)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask,
             "aux": _aux(tiny_target, draft, ids)}
    module = DSparkModule(draft, None, num_anchors=64, gamma=2.0)
    opt = torch.optim.Adam(draft.parameters(), lr=2e-2)
    gen, losses = torch.Generator().manual_seed(0), []
    for _ in range(25):
        loss = module.block_step(batch, gen).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return SimpleNamespace(draft=draft.eval(), seq=seq, losses=losses, parts=module._parts)


def test_training_lowers_every_loss(trained):
    assert sum(trained.losses[-5:]) / 5 < 0.5 * trained.losses[0], trained.losses
    assert trained.draft.markov_head.markov_w2.weight.abs().sum() > 0  # the Markov head left zero and learned
    assert set(trained.parts) == {"base_loss", "markov_loss", "confidence_loss"}


@pytest.mark.parametrize("which", ["fresh", "trained"])
def test_greedy_output_equals_autoregressive(tiny_target, trained, which):
    draft = trained.draft if which == "trained" else build_draft(tiny_target, seed=3, **SIZES)
    taus = []
    for prompt, n in [(TRAIN_PROMPTS[0], 30), (UNSEEN_PROMPT, 12)]:
        cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
        ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
        for drafter in (DSparkDrafter(draft), DSparkDrafter(draft, confidence_threshold=0.3)):
            out, stats = speculative_generate(tiny_target, prompt, drafter, cfg)
            assert out == ref
            taus.append(stats.tau)
    if which == "trained":
        assert taus[0] > 1.5, taus  # the chain drafts what the Markov loss trained, so whole blocks get accepted


def test_a_fresh_head_on_a_dflash_draft_drafts_as_that_draft(tiny_target, tmp_path):
    base = build_dflash(tiny_target, num_layers=1, block_size=BS, seed=5)
    path = save_dflash(base, tmp_path / "dflash", target=tiny_target)
    draft = build_draft(tiny_target, num_layers=1, block_size=BS, markov_rank=RANK, init={"from": str(path)})
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, stop_on_eos=False)
    ref, ref_stats = speculative_generate(tiny_target, TRAIN_PROMPTS[1], DFlashDrafter(base), cfg, trace=True)
    out, stats = speculative_generate(tiny_target, TRAIN_PROMPTS[1], DSparkDrafter(draft), cfg, trace=True)
    assert out == ref and all(torch.equal(a.tokens, b.tokens) for a, b in zip(stats.trace, ref_stats.trace))


def test_save_load_round_trip(tiny_target, trained, tmp_path):
    path = save_artifact(trained.draft, tmp_path / "dspark", target=tiny_target)
    loaded = load_artifact(path, target=tiny_target)
    a, b = trained.draft.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = build_draft(tiny_target, init={"from": str(path)}, **SIZES)  # init.from a DSpark artifact continues it
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in a.items())
    with pytest.raises(Exception, match="markov_rank"):
        build_draft(tiny_target, init={"from": str(path)}, **{**SIZES, "markov_rank": RANK + 1})


def test_export_is_the_vllm_dspark_structure_and_validate_names_the_problem(tiny_target, trained, tmp_path):
    path = save_artifact(trained.draft, tmp_path / "dspark", target=tiny_target)
    cfg = json.loads((path / "config.json").read_text())
    c, V, d = trained.draft.config, tiny_target.geometry.vocab_size, tiny_target.geometry.hidden_size
    # What vllm/model_executor/models/qwen3_dspark.py and its DSpark speculator read.
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["markov_rank"], cfg["enable_confidence_head"], cfg["draft_vocab_size"]) == (RANK, True, V)
    assert cfg["confidence_head_with_markov"] is False and cfg["sample_from_anchor"] is False
    dc = cfg["dflash_config"]
    assert (dc["mask_token_id"], dc["block_size"], dc["target_layer_ids"]) == (c.mask_token_id, BS, c.target_layer_ids)
    tensors = load_file(str(path / "model.safetensors"))
    heads = {"markov_head.markov_w1.weight": (V, RANK), "markov_head.markov_w2.weight": (V, RANK),
             "confidence_head.proj.weight": (1, d), "confidence_head.proj.bias": (1,)}
    assert {k: tuple(tensors[k].shape) for k in heads} == heads
    assert "fc.weight" in tensors and not any(k.startswith(("embed", "lm_head")) for k in tensors)
    assert validate(path, target=tiny_target) == []

    def broken(edit_weights=None, edit_config=None):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        t = load_file(str(path / "model.safetensors"))
        (edit_weights or (lambda x: None))(t)
        save_file(t, str(bad / "model.safetensors"))
        conf = copy.deepcopy(cfg)
        (edit_config or (lambda x: None))(conf)
        (bad / "config.json").write_text(json.dumps(conf))
        return validate(bad, target=tiny_target)

    assert broken(lambda t: t.pop("markov_head.markov_w2.weight")) == [
        f"missing tensor 'markov_head.markov_w2.weight' {(V, RANK)}"]
    assert broken(lambda t: t.update({"confidence_head.proj.weight": torch.zeros(2, d)})) == [
        f"tensor 'confidence_head.proj.weight' has shape (2, {d}), the config needs (1, {d})"]
    assert any("'confidence_head_with_markov' must be false" in p
               for p in broken(edit_config=lambda x: x.update(confidence_head_with_markov=True)))
    assert any("'markov_rank'" in p for p in broken(edit_config=lambda x: x.update(markov_rank=RANK + 1)))
    with pytest.raises(ValueError, match="missing tensor 'markov_head.markov_w1.weight'"):
        load_artifact(_without(path, tmp_path, "markov_head.markov_w1.weight"), target=tiny_target)


def _without(path, tmp_path, key):
    out = tmp_path / "without"
    out.mkdir()
    t = load_file(str(path / "model.safetensors"))
    t.pop(key)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    return out


# ---- the law of the sampled chain ------------------------------------------------------------------------


def _state(target, draft, seq, anchor, temperature):
    aux = _aux(target, draft, torch.tensor([seq[:anchor]]))[0]  # [anchor, n_taps*d]
    return DecodeState(target=target, cache=None, tokens=list(seq[:anchor + 1]), prompt_len=anchor,
                       temperature=temperature, accepted_aux=aux, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def markov(trained):
    """The trained draft with a strong random Markov head: each slot's law visibly depends on the token before."""
    draft = copy.deepcopy(trained.draft)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        draft.markov_head.markov_w2.weight.copy_(torch.randn(draft.markov_head.markov_w2.weight.shape, generator=g))
    return draft


class ReportsTheBaseLaw(DSparkDrafter):
    """Draws with the Markov bias, reports each slot's law without it."""

    def _draw_markov(self, logits, state, greedy):
        tokens, rows = super()._draw_markov(logits, state, greedy)
        if rows is None:
            return tokens, rows
        return tokens, logits_to_probs(logits[: len(tokens)], state.temperature, state.top_k, state.top_p)


class DrawsTheBaseLaw(DSparkDrafter):
    """Draws each slot from its base law, reports the Markov law given the token drawn before it."""

    def _draw_markov(self, logits, state, greedy):
        if greedy:
            return super()._draw_markov(logits, state, greedy)
        tokens = sample(logits_to_probs(logits, state.temperature, state.top_k, state.top_p), state.generator)
        prev = torch.cat([torch.tensor([state.root]), tokens[:-1]])
        rows = logits_to_probs(logits + self.draft.markov_bias(prev), state.temperature, state.top_k, state.top_p)
        return tokens, rows


def _first_two_slots(drafter, state, n: int):
    """(draws [n, 2], the rows reported for them [n, 2, V]) over ``n`` proposals from one state."""
    drafter.reset(state)
    draws, rows = [], []
    for seed in range(n):
        state.generator = torch.Generator().manual_seed(seed)
        tree = drafter.propose(state)
        draws.append(tree.tokens[1:3])
        rows.append(tree.draft_probs[1:3].float())
    return torch.stack(draws), torch.stack(rows)


def _law_p_value(draws, rows) -> float:
    """Chi-square p-value of the draws of each slot against the sum of the rows reported beside them (the
    expected counts: for slot 2 the row depends on slot 1's draw, and E[1{y = v}] = E[q(v)] still holds).
    Bins: tokens expecting >= 5 draws, the rest pooled; a draw its reported row cannot draw gives p = 0."""
    if not bool((rows.gather(2, draws[:, :, None]) > 0).all()):
        return 0.0
    obs, exp = [], []
    for slot in range(draws.shape[1]):
        counts = torch.bincount(draws[:, slot], minlength=rows.shape[2]).double()  # [V]
        e = rows[:, slot].double().sum(0)  # [V]
        big = e >= 5
        o_s, e_s = counts[big].tolist(), e[big].tolist()
        o_s, e_s = o_s + [float(counts[~big].sum())], e_s + [float(e[~big].sum())]
        obs, exp = obs + o_s, exp + e_s
    keep = [i for i, x in enumerate(exp) if x > 0]
    obs, exp = [obs[i] for i in keep], [exp[i] for i in keep]
    return float(chisquare(obs, [x * sum(obs) / sum(exp) for x in exp]).pvalue)


def test_the_sampled_chain_draws_from_the_markov_law_it_reports(tiny_target, trained, markov):
    seq, anchor, t, top_k = trained.seq, 24, 1.0, 12
    ids, ones = torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long)
    blocks = make_blocks(ids, ones, ones, block_size=BS, mask_token_id=markov.config.mask_token_id,
                         anchors=torch.tensor([[anchor]]))
    with torch.no_grad():
        base = block_logits(markov, _aux(tiny_target, markov, ids), blocks)[0, 0]  # [BS-1, V], the training path
    state = _state(tiny_target, markov, seq, anchor, t)
    state.top_k = top_k
    draws, rows = _first_two_slots(DSparkDrafter(markov), state, N_DRAWS)
    # Each reported row is the Markov law at the sampling settings, given the token drawn before it.
    with torch.no_grad():
        prev = torch.stack([torch.full((N_DRAWS,), seq[anchor]), draws[:, 0]], 1)  # [n, 2]
        want = logits_to_probs(base[:2] + markov.markov_bias(prev), t, top_k)  # [n, 2, V]
    torch.testing.assert_close(rows, want, atol=1e-5, rtol=0)
    assert len(set(draws[:, 0].tolist())) > 3 and _law_p_value(draws, rows) > 1e-4
    # The two slips draw from one law and report the other: the same check rejects them outright.
    for mutant in (ReportsTheBaseLaw, DrawsTheBaseLaw):
        assert _law_p_value(*_first_two_slots(mutant(markov), state, MUTANT_DRAWS)) < 1e-6, mutant.__name__


@pytest.mark.parametrize("cls", [DSparkDrafter, ReportsTheBaseLaw])
def test_the_first_round_check_passes_the_drafter_and_kills_the_slip(tiny_target, trained, markov, cls):
    """The engine-level exact-null check (``check_first_round_law``): its second family compares each round's
    first drafted token with the row reported beside it, accepted or not, so the slip fails it."""
    def run():
        return check_first_round_law(tiny_target, lambda: cls(markov), trained.seq[:24], temperature=0.3,
                                     trials=FIRST_ROUND_TRIALS)

    if cls is DSparkDrafter:
        assert run()["drafted_p"] > 1e-3
    else:
        with pytest.raises(AssertionError, match="do not follow the target"):
            run()


def test_the_confidence_cut_never_looks_at_the_draws(tiny_target, trained, markov):
    """``tree: auto``: the length comes from the confidence estimates of the block pass; different draws, one
    length. The same length at T = 0, where the chain is the Markov argmax chain."""
    seq, anchor = trained.seq, 24
    drafter = DSparkDrafter(markov, tree="auto")
    drafter.budget = TreeBudget(VerifyCost.linear(0.01, 0.004), level_seconds=0.0, decay=1.0)
    state = _state(tiny_target, markov, seq, anchor, 1.0)
    drafter.reset(state)
    lengths = set()
    for seed in range(20):
        state.generator = torch.Generator().manual_seed(seed)
        lengths.add(drafter.propose(state).size)
    state.temperature = 0.0
    greedy = drafter.propose(state)
    assert lengths == {greedy.size} and greedy.deterministic
    conf = markov.confidence(torch.zeros(3, tiny_target.geometry.hidden_size))
    assert conf is not None and conf.shape == (3,) and bool(((conf > 0) & (conf < 1)).all())
