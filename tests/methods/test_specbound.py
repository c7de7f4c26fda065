"""SpecBound on a 6-layer tiny target: exact layer-level rounds, rollback, exactness, training, artifacts."""

from __future__ import annotations

import json

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.specbound.build import build_draft, load_artifact, save_artifact
from draftlab.methods.specbound.drafter import SpecBoundDrafter
from draftlab.methods.specbound.heads import SpecBoundConfig, act_temperature, default_exit_layers
from draftlab.methods.specbound.module import SpecBoundModule, chain_lengths, first_exit


@pytest.fixture(scope="module")
def deep_target():
    from draftlab.targets.tiny import tiny_random_target

    return tiny_random_target(num_layers=6, seed=3)


def _state(target, prompt: list[int], extra_rows: int = 16):
    from draftlab.decoding.drafter import DecodeState

    cache = target.new_cache(1, len(prompt) + 64)
    out = target.forward(torch.tensor([prompt[:-1]]), cache=cache)
    cache.commit(len(prompt) - 1)
    assert out.logits.shape[1] == len(prompt) - 1
    return DecodeState(target=target, cache=cache, tokens=list(prompt), prompt_len=len(prompt) - 1, temperature=0.0)


def test_act_schedule_and_default_heads():
    assert act_temperature(0, 30, 2.0) == 3.0 and act_temperature(30, 30, 2.0) == 1.0
    assert act_temperature(15, 30, 1.0) == pytest.approx(1.5)
    assert default_exit_layers(30) == [6, 12, 18, 24] and default_exit_layers(2) == [1]
    with pytest.raises(ValueError, match=r"exit_layers \[6\] are not in \[1, 6\)"):
        SpecBoundConfig(exit_layers=(2, 6), num_layers=6, hidden_size=8, vocab_size=10)
    with pytest.raises(ValueError, match="distinct and ascending"):
        SpecBoundConfig(exit_layers=(3, 2), num_layers=6, hidden_size=8, vocab_size=10)


@pytest.mark.parametrize("tau", [0.0, 0.02, 1.01])
def test_a_round_completes_to_the_full_forward_logits(deep_target, tau):
    # tau 0: every token exits at the first head (w_max drafted); 0.02: exits spread over the heads, some
    # tokens difficult; above 1: nothing exits (the root alone). Every case must equal a full forward.
    torch.manual_seed(0)
    heads = build_draft(deep_target, exit_layers=[1, 3, 4])
    with torch.no_grad():
        for w in heads.maps:
            w.add_(0.3 * torch.randn_like(w))  # trained-looking heads: exits at different depths
    drafter = SpecBoundDrafter(heads, alpha=1.0, tau=tau, w_max=5)
    prompt = [5, 17, 300, 42, 9, 1000, 77]
    state = _state(deep_target, prompt)
    drafter.reset(state)
    tree = drafter.propose(state)
    if tau == 0.0:
        assert tree.size == 6 and set(drafter.exit_depths) == {1}
    if tau > 1:
        assert tree.size == 1
    out = drafter.verify_forward(state, tree)
    ref_cache = deep_target.new_cache(1, 64)
    ids = torch.tensor([prompt[:-1] + tree.tokens.tolist()])
    ref = deep_target.forward(ids, cache=ref_cache).logits[0, len(prompt) - 1:]  # [N, V]
    # fp32 to 1e-5 of the logit scale (these reach |8|; single-token AR steps differ from this same full
    # forward by 1.2e-5 absolute, as any two matmul shapes do). A missed layer or row is off by O(1).
    assert (out.logits[0] - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Every layer's K/V of the round's rows is in place at the scratch slots, as a full verify pass leaves it.
    n, past = tree.size, state.cache.length
    assert torch.allclose(state.cache.k[:, :, :, past:past + n], ref_cache.k[:, :, :, past:past + n], atol=1e-5)
    assert torch.allclose(state.cache.v[:, :, :, past:past + n], ref_cache.v[:, :, :, past:past + n], atol=1e-5)


def test_rollback_leaves_the_cache_of_a_run_that_never_saw_the_rejected_tokens(deep_target):
    torch.manual_seed(1)
    heads = build_draft(deep_target, exit_layers=[2, 4])
    drafter = SpecBoundDrafter(heads, tau=0.0, w_max=4)
    prompt = [11, 400, 23, 8, 512]
    state = _state(deep_target, prompt)
    drafter.reset(state)
    tree = drafter.propose(state)
    drafter.verify_forward(state, tree)
    keep = 2  # root + one drafted token accepted, the rest rejected
    state.cache.commit_rows(list(range(keep)))
    kept = prompt[:-1] + tree.tokens[:keep].tolist()
    clean = deep_target.new_cache(1, 64)
    deep_target.forward(torch.tensor([kept]), cache=clean)
    clean.commit(len(kept))
    n = clean.length
    assert state.cache.length == n and not state.cache.ragged
    assert torch.allclose(state.cache.k[:, :, :, :n], clean.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(state.cache.v[:, :, :, :n], clean.v[:, :, :, :n], atol=1e-5)
    # The next round drafts from there exactly as from the clean cache.
    state.tokens[:] = kept + [int(deep_target.forward(torch.tensor([kept])).logits[0, -1].argmax())]
    nxt = drafter.propose(state)
    assert nxt.size >= 1 and drafter.verify_forward(state, nxt).logits.shape[1] == nxt.size


@pytest.mark.parametrize("tau", [0.0, 0.05])
def test_greedy_equals_autoregressive(deep_target, tau):
    torch.manual_seed(2)
    heads = build_draft(deep_target, exit_layers=[2, 3, 5])
    with torch.no_grad():
        for w in heads.maps:
            w.add_(0.2 * torch.randn_like(w))
    cfg = GenerationConfig(max_new_tokens=40, temperature=0.0, stop_on_eos=False)
    prompt = [1, 2, 3, 500, 60, 7000, 8]
    ar, _ = autoregressive_generate(deep_target, prompt, cfg)
    drafter = SpecBoundDrafter(heads, tau=tau, w_max=4)
    spec, stats = speculative_generate(deep_target, prompt, drafter, cfg)
    assert spec == ar
    assert stats.rounds < len(ar) or tau > 0  # with every token exiting, rounds carry drafts
    # The per-sequence report: every drafted token counted at its exit layer, every round's end reason.
    d = stats.drafter_stats
    assert d["drafted"] == len(drafter.exit_depths) == sum(d[f"exits_l{layer}"] for layer in (2, 3, 5))
    assert d["rounds_difficult"] + d["rounds_width"] == stats.rounds
    if tau == 0.0:
        assert d["mean_exit_layer"] == 2.0 and d["rounds_difficult"] == 0


def test_exit_statistics_and_chains():
    conf = {1: torch.tensor([[0.9, 0.1, 0.1]]), 3: torch.tensor([[0.95, 0.9, 0.2]])}
    agree = {1: torch.tensor([[False, True, True]]), 3: torch.tensor([[True, True, False]])}
    exited, layer, right = first_exit(conf, agree, tau=0.8, d_max=3)
    assert exited.tolist() == [[True, True, False]] and layer.tolist() == [[1, 3, 0]]
    assert right.tolist() == [[False, True, False]]  # the first exit decides, not a deeper head
    exited, _, _ = first_exit(conf, agree, tau=0.8, d_max=2)
    assert exited.tolist() == [[True, False, False]]
    success = torch.tensor([[True, True, False, True, True, True]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    assert chain_lengths(success, valid, w_max=9).tolist() == [[2, 1, 0, 2, 1, 0]]
    assert chain_lengths(success, valid, w_max=1).tolist() == [[1, 1, 0, 1, 1, 0]]


def _batch(target, n: int = 4, T: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.geometry.vocab_size, (n, T), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(n, T, dtype=torch.long),
            "loss_mask": torch.ones(n, T, dtype=torch.long)}


def test_training_lowers_the_kl_and_validation_reports_the_calibration(deep_target):
    torch.manual_seed(0)
    heads = build_draft(deep_target, exit_layers=[2, 4])
    module = SpecBoundModule(heads, deep_target, tau=0.3, max_positions=64)
    batch = _batch(deep_target)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    losses = []
    for _ in range(25):
        loss = module.training_step(batch, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert not any(p.requires_grad for p in deep_target.model.parameters())
    module.log_dict = lambda d, **kw: module.__dict__.setdefault("_logged", {}).update(d)
    module.on_validation_epoch_start()
    module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    logs = module._logged
    for layer in (2, 4):
        assert 0.0 <= logs[f"val/agree_l{layer}"] <= 1.0 and logs[f"val/kl_l{layer}"] >= 0.0
        for key in ("exit_rate", "exit_precision", "raw_exit_rate", "raw_exit_precision"):
            assert 0.0 <= logs[f"val/{key}_l{layer}"] <= 1.0
        # ACT only ever lowers confidence (T_l >= 1): fewer exits than the raw heads.
        assert logs[f"val/exit_rate_l{layer}"] <= logs[f"val/raw_exit_rate_l{layer}"]
    assert 1.0 <= logs["val/simulated_tau"] <= 1.0 + module.w_max
    assert logs["val/mean_exit_layer"] in (0.0,) or 2 <= logs["val/mean_exit_layer"] <= 4


def test_artifact_round_trip_and_errors(deep_target, tiny_target, tmp_path):
    torch.manual_seed(0)
    heads = build_draft(deep_target, exit_layers=[1, 5])
    with torch.no_grad():
        heads.maps[1].mul_(1.5)
    path = save_artifact(heads, tmp_path / "heads")
    back = load_artifact(path, target=deep_target)
    assert back.exit_layers == (1, 5) and all(torch.equal(a, b) for a, b in zip(heads.maps, back.maps))
    with pytest.raises(ValueError, match=r"\(layers, hidden, vocab\)"):
        load_artifact(path, target=tiny_target)  # a 2-layer target
    cfg = json.loads((path / "specbound_config.json").read_text())
    cfg["exit_layers"] = [1, 2, 5]
    (path / "specbound_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="heads.safetensors: does not match"):
        load_artifact(path)
    (path / "heads.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="heads.safetensors: unreadable"):
        load_artifact(path)
    with pytest.raises(ValueError, match="draft_vocab_size: null"):
        build_draft(deep_target, vocab=object())


def test_without_a_depth_bound_the_final_layer_drafts_and_every_draft_is_accepted(deep_target):
    # d_max = L: a token no head lets exit runs all layers and is drafted from the target's own logits, so at
    # T = 0 verification accepts every drafted token, and every round ends at w_max.
    heads = build_draft(deep_target, exit_layers=[2, 4])
    drafter = SpecBoundDrafter(heads, tau=1.01, d_max=6, w_max=3)  # tau > 1: no head ever exits
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, stop_on_eos=False)
    prompt = [4, 44, 444, 4444]
    ar, _ = autoregressive_generate(deep_target, prompt, cfg)
    spec, stats = speculative_generate(deep_target, prompt, drafter, cfg)
    assert spec == ar and all(a == 4 for a in stats.accept_lengths[:-1])  # 3 drafts + the bonus token
    assert stats.drafter_stats["exits_l6"] == stats.drafter_stats["drafted"] > 0
    with pytest.raises(ValueError, match="deeper than the target's 6 layers"):
        SpecBoundDrafter(heads, d_max=7)
