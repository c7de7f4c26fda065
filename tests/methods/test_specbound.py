"""SpecBound on a 6-layer tiny target: exact layer-level rounds, rollback, exactness, training, artifacts."""

from __future__ import annotations

import json

import pytest
import torch

from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.specbound.build import build_draft, load_artifact, save_artifact
from draftlab.methods.specbound.drafter import SpecBoundDrafter
from draftlab.methods.specbound.heads import SpecBoundConfig, act_temperature, default_exit_layers
from draftlab.methods.specbound.module import SpecBoundModule, chain_lengths, first_exit
from draftlab.targets.base import PassRequest


@pytest.fixture(scope="module")
def deep_target():
    from draftlab.targets.tiny import tiny_random_target

    return tiny_random_target(num_layers=6, seed=3)


def _state(target, prompt: list[int], extra_rows: int = 16):
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


@pytest.mark.parametrize("tau", [0.0, 0.001, 0.0012, 1.01])
def test_a_round_completes_to_the_full_forward_logits(deep_target, tau):
    # tau 0: every token exits at the first head (w_max drafted); 0.001: exits spread over heads 3 and 4;
    # 0.0012: a difficult token ends the round early (these heads' confidences over 49k tokens are ~1e-3);
    # above 1: nothing exits (the root alone). Every case must equal a full forward.
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
    elif tau == 0.001:
        assert tree.size == 6 and set(drafter.exit_depths) == {3, 4}
    elif tau == 0.0012:
        assert 1 < tree.size < 6 and drafter.sequence_stats()["rounds_difficult"] == 1
    else:
        assert tree.size == 1
    out = drafter.verify_forward(state, tree)
    ref_cache = deep_target.new_cache(1, 64)
    ids = torch.tensor([prompt[:-1] + tree.tokens.tolist()])
    ref = deep_target.forward(ids, cache=ref_cache).logits[0, len(prompt) - 1:]  # [N, V]
    # fp32 to 1e-5 of the logit scale (these reach |8|; single-token AR steps differ from this same full
    # forward by 1.2e-5 absolute, as any two matmul shapes do). A missed layer or row is off by O(1).
    assert (out.logits[0] - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Every layer's K/V of the round's rows is in place at the scratch slots, as a full verify pass leaves it
    # (to the same 1e-5 of scale: rows that reached different depths run through other matmul shapes).
    n, past = tree.size, state.cache.length
    for got, want in ((state.cache.k, ref_cache.k), (state.cache.v, ref_cache.v)):
        got, want = got[:, :, :, past:past + n], want[:, :, :, past:past + n]
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


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
    # The next round drafts from there exactly as a fresh drafter does from the clean cache: the same
    # tokens at the same exit layers, and the same completed logits.
    state.tokens[:] = kept + [int(deep_target.forward(torch.tensor([kept])).logits[0, -1].argmax())]
    depths = len(drafter.exit_depths)
    nxt = drafter.propose(state)
    fresh = SpecBoundDrafter(heads, tau=0.0, w_max=4)
    clean_state = DecodeState(target=deep_target, cache=clean, tokens=list(state.tokens), prompt_len=len(prompt) - 1,
                              temperature=0.0)
    fresh.reset(clean_state)
    ref = fresh.propose(clean_state)
    assert nxt.tokens.tolist() == ref.tokens.tolist() and drafter.exit_depths[depths:] == fresh.exit_depths
    torch.testing.assert_close(drafter.verify_forward(state, nxt).logits, fresh.verify_forward(clean_state, ref).logits,
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _exit_head_logits(target, heads, ids: torch.Tensor, layers, start: int) -> dict[int, torch.Tensor]:
    """Per exit layer, the head's logits ``[T - start, V]`` at rows ``start:`` of ``ids [1, T]``, from one plain
    causal forward (the residual stream after ``l`` layers is the output of layer ``l - 1``), independent of
    the drafter's layer-level cache."""
    aux = target.forward(ids, request=PassRequest(aux=[layer - 1 for layer in layers], logits_rows=torch.arange(0))).aux_hidden[:, start:]  # [1, T - start, n*d]
    return {layer: heads.logits(target, h, layer)[0].float()
            for layer, h in zip(layers, aux.split(target.geometry.hidden_size, -1))}


# The untrained heads' ACT confidences over the 49k vocabulary are 5e-4 .. 8e-3: at tau 0.002 tokens exit at
# layers 3 and 5 and some are difficult.
@pytest.mark.parametrize("tau", [0.0, 0.002, 1.01])
def test_greedy_rounds_follow_the_exit_rule_and_equal_autoregressive(deep_target, tau):
    torch.manual_seed(2)
    heads = build_draft(deep_target, exit_layers=[2, 3, 5])
    with torch.no_grad():
        for w in heads.maps:
            w.add_(0.2 * torch.randn_like(w))
    cfg = GenerationConfig(max_new_tokens=28, temperature=0.0, stop_on_eos=False)
    prompt = [1, 2, 3, 500, 60, 7000, 8]
    ar, _ = autoregressive_generate(deep_target, prompt, cfg)
    w_max, stops = 4, (2, 3, 5)
    drafter = SpecBoundDrafter(heads, tau=tau, w_max=w_max)
    spec, stats = speculative_generate(deep_target, prompt, drafter, cfg, trace=True)
    assert spec == ar
    # Replay every round from a plain forward over its rows: a row drafts the next token at the first head
    # whose ACT confidence reaches tau (the head's argmax at T = 0); a row no head lets exit is difficult
    # and ends the round; otherwise the round ends after w_max tokens.
    L, seq, depths, width = deep_target.geometry.num_layers, prompt + ar, iter(drafter.exit_depths), 0
    for r in stats.trace:
        n = len(r.tokens)
        assert seq[r.anchor] == int(r.tokens[0]) and 1 <= n <= w_max + 1
        ids = torch.tensor([seq[:r.anchor] + r.tokens.tolist()])
        z = _exit_head_logits(deep_target, heads, ids, stops, r.anchor)  # layer -> [n, V]
        act = {layer: torch.softmax(z[layer] / act_temperature(layer, L, 1.0), -1).amax(-1).tolist()
               for layer in stops}  # layer -> n ACT confidences
        for i in range(n if n <= w_max else n - 1):  # rows that were asked for a next token
            # A confidence within 0.1 % of tau may round either way between two forward paths.
            passes = {layer: act[layer][i] >= tau * (1 - 1e-3) for layer in stops}
            fails = {layer: act[layer][i] < tau * (1 + 1e-3) for layer in stops}
            if i == n - 1:  # the round's last row: a difficult token
                assert all(fails.values()), (r.anchor, i)
                continue
            layer = next(depths)
            assert passes[layer] and all(fails[x] for x in stops if x < layer), (r.anchor, i, layer)
            assert int(r.tokens[i + 1]) == int(z[layer][i].argmax())
        width += n == w_max + 1
    assert next(depths, None) is None  # every recorded exit belongs to a drafted token
    d = stats.drafter_stats
    assert d["drafted"] == sum(stats.tree_sizes) - stats.rounds == len(drafter.exit_depths)
    assert all(d[f"exits_l{layer}"] == drafter.exit_depths.count(layer) for layer in stops)
    assert d["rounds_width"] == width and d["rounds_difficult"] == stats.rounds - width
    if tau == 0.0:  # every token exits at the first head: every round drafts w_max tokens
        assert set(drafter.exit_depths) == {2} and d["mean_exit_layer"] == 2.0
        assert stats.tree_sizes == [w_max + 1] * stats.rounds and d["rounds_difficult"] == 0
    elif tau > 1:  # no confidence reaches it: every round is the root alone, ended by a difficult token
        assert stats.tree_sizes == [1] * stats.rounds and stats.rounds == len(ar) - 1
        assert d["drafted"] == 0 and d["rounds_difficult"] == stats.rounds
    else:  # the setting exercises both ends and more than one exit layer
        assert 0 < width < stats.rounds and len(set(drafter.exit_depths)) > 1, (d, stats.tree_sizes)


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
    # These heads' confidences over the 49k vocabulary are ~1e-3 (raw ~4e-3): at tau 0.001 the ACT policy
    # exits at both heads and not everywhere, at 0.004 about half the raw confidences pass. A w_max of 2 is
    # short enough for runs of right exits to reach it.
    module.w_max = 2
    for tau in (0.001, 0.004):
        module.tau = tau
        module.on_validation_epoch_start()
        module.validation_step(batch, 0)
        module.on_validation_epoch_end()
        logs = module._logged
        assert logs == pytest.approx(_validation_by_hand(module, batch), rel=1e-5, abs=1e-6)
        # ACT only ever lowers confidence (T_l >= 1): fewer exits than the raw heads.
        assert all(logs[f"val/exit_rate_l{layer}"] <= logs[f"val/raw_exit_rate_l{layer}"] for layer in (2, 4))
        if tau == 0.001:
            assert 0 < logs["val/policy_exit_rate"] < 1 and 2 < logs["val/mean_exit_layer"] < 4
            assert logs["val/simulated_tau"] > 1
        else:
            assert all(0 < logs[f"val/raw_exit_rate_l{layer}"] < 1 for layer in (2, 4))


@torch.no_grad()
def _validation_by_hand(module, batch) -> dict[str, float]:
    """The validation report recomputed position by position from one plain forward of the batch (every
    position counts: its masks are all ones). The policy is the drafter's: a position exits at the first
    head up to d_max whose ACT confidence reaches tau and is right when that head's argmax is the final
    layer's; its chain is the run of right positions from it, at most w_max long."""
    target, heads, tau = module.target, module.draft, module.tau
    ids = batch["input_ids"]
    out = target.forward(ids, request=PassRequest(aux=[layer - 1 for layer in heads.exit_layers]))
    logp = torch.log_softmax(out.logits.float(), -1)  # [B, T, V]
    n, L = ids.numel(), target.geometry.num_layers
    logs, exit_at, right = {}, torch.zeros(ids.shape, dtype=torch.long), torch.zeros(ids.shape, dtype=torch.bool)
    for layer, h in zip(heads.exit_layers, out.aux_hidden.split(target.geometry.hidden_size, -1)):
        z = heads.logits(target, h, layer).float()  # [B, T, V]
        logq = torch.log_softmax(z, -1)
        agree = z.argmax(-1) == logp.argmax(-1)  # [B, T]
        logs[f"val/agree_l{layer}"] = agree.sum().item() / n
        logs[f"val/kl_l{layer}"] = (logp.exp() * (logp - logq)).sum(-1).sum().item() / n
        act = torch.softmax(z / act_temperature(layer, L, module.alpha), -1).amax(-1)  # [B, T]
        for prefix, conf in (("val/", act), ("val/raw_", logq.exp().amax(-1))):
            exits = conf >= tau
            logs[f"{prefix}exit_rate_l{layer}"] = exits.sum().item() / n
            logs[f"{prefix}exit_precision_l{layer}"] = (exits & agree).sum().item() / max(exits.sum().item(), 1)
        if layer <= module.d_max:
            first = (act >= tau) & (exit_at == 0)
            exit_at[first], right[first] = layer, agree[first]
    exited = exit_at > 0
    chains = 0
    for row in right.tolist():
        for t in range(len(row)):
            run = 0
            while t + run < len(row) and row[t + run] and run < module.w_max:
                run += 1
            chains += run
    logs["val/policy_exit_rate"] = exited.sum().item() / n
    logs["val/mean_exit_layer"] = exit_at[exited].double().mean().item() if exited.any() else 0.0
    logs["val/simulated_tau"] = 1.0 + chains / n
    logs["val/loss"] = sum(logs[f"val/kl_l{layer}"] for layer in heads.exit_layers)
    return logs


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
