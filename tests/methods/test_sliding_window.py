"""Sliding-window drafts (``draft.sliding_window``; convention in ``draftlab.nn.window``: a query at position p sees
keys at positions > p - W, its own included), for the DFlash family and EAGLE-3.

For each: a window covering the whole sequence changes nothing (bit for bit); a small one changes exactly the rows
whose window cuts a key, as a brute-force explicit mask says; training and the drafter compute the same rows;
greedy decoding with a windowed (random) draft is still the target's own output; the exports carry the window
and read it back, and a draft without one exports exactly the keys it always did.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.kernels import ttt_attention as kernel
from draftlab.methods.dflash import DFlashDrafter, build_draft
from draftlab.methods.dflash import export as dflash_export
from draftlab.methods.dflash.blocks import block_attention_mask, block_logits, context_mask, make_blocks
from draftlab.methods.dflash.config import DFlashConfig
from draftlab.methods.eagle3 import CausalAttention, Eagle3Config, Eagle3Draft, Eagle3Drafter, TTTAttention
from draftlab.methods.eagle3.draft_cache import DraftRows
from draftlab.methods.eagle3.export import (
    load_native,
    load_speculators,
    save_sglang,
    save_speculators,
    save_vllm,
    validate_sglang,
    validate_speculators,
    validate_vllm,
)
from draftlab.methods.eagle3.model import masked_attention
from draftlab.methods.eagle3.ttt import naive_ttt_attention
from draftlab.methods.registry import MethodSpec
from draftlab.targets.base import PassRequest
from tests.export.export_testlib import draft_outputs, edit_config, tiny_draft
from tests.methods.corpus import TRAIN_PROMPTS

BS = 4


def _seq(n: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, 5000, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, n]


# ------------------------------------------------------------------------------------------------------
# DFlash


def _dflash(target, window, *, layers: int = 1):
    """The same seeded draft (the window draws nothing), with ``window``."""
    return build_draft(target, num_layers=layers, block_size=BS, seed=0, sliding_window=window)


def _dflash_aux(target, draft, ids):
    return target.forward(ids, request=PassRequest(aux=draft.taps(target), logits_rows=torch.arange(0))).aux_hidden


def _dflash_blocks(draft, ids, anchors):
    ones = torch.ones_like(ids)
    return make_blocks(ids, ones, ones, block_size=BS, mask_token_id=draft.config.mask_token_id,
                       anchors=torch.tensor([anchors]))


def _dflash_drafter_logits(target, draft, ids, anchor):
    """The drafter's slot logits ``[BS-1, V]`` for the block at ``anchor`` after a prompt ``ids[:anchor + 1]``."""
    aux = _dflash_aux(target, draft, ids[:, :anchor])[0]
    seq = ids[0].tolist()
    state = DecodeState(target=target, cache=None, tokens=seq[:anchor + 1], prompt_len=anchor, temperature=0.0,
                        accepted_aux=aux)
    drafter = DFlashDrafter(draft)
    drafter.reset(state)
    block = torch.full((1, BS), draft.config.mask_token_id)
    block[0, 0] = seq[anchor]
    return drafter._block_pass((block, torch.arange(anchor, anchor + BS)))[1]


def test_dflash_window_over_the_whole_sequence_changes_nothing(tiny_target):
    ids = _seq()
    full, wide = _dflash(tiny_target, None), _dflash(tiny_target, ids.shape[1] + BS)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), wide.state_dict().values()))
    blocks = _dflash_blocks(full, ids, [3, 9, 15])
    aux = _dflash_aux(tiny_target, full, ids)
    assert torch.equal(block_logits(wide, aux, blocks), block_logits(full, aux, blocks))
    assert torch.equal(_dflash_drafter_logits(tiny_target, wide, ids, 12),
                       _dflash_drafter_logits(tiny_target, full, ids, 12))


@pytest.mark.parametrize("layers", [1, 2])
def test_dflash_small_window_is_the_explicit_mask(tiny_target, layers):
    """The windowed draft equals the full draft under a hand-built mask (row at p = a + k sees a > t > p - W), and
    it changes exactly the rows that lose a key: with one layer each such slot; with two, its whole block (the
    block is bidirectional, so the second layer mixes the first layer's rows)."""
    W, T, anchors = 7, 20, [2, 5, 9, 15]
    ids = _seq(T)
    full, win = _dflash(tiny_target, None, layers=layers), _dflash(tiny_target, W, layers=layers)
    blocks = _dflash_blocks(full, ids, anchors)
    aux = _dflash_aux(tiny_target, full, ids)
    a = torch.tensor(anchors)[:, None]  # [A, 1]
    pos = a + torch.arange(BS)  # [A, BS]: each row's position
    t = torch.arange(T)
    explicit = ((t < a[:, :, None]) & (t > pos[:, :, None] - W)).reshape(1, -1, T)  # [1, A*BS, T]
    assert torch.equal(context_mask(torch.tensor([anchors]), torch.ones_like(ids), BS, W), explicit)
    assert torch.equal(block_attention_mask(torch.tensor([anchors]), torch.ones_like(ids), BS, W)[..., :T], explicit)

    got = block_logits(win, aux, blocks)  # [1, A, BS-1, V]: the draft applies its own window
    want = block_logits(full, aux, dataclasses.replace(blocks, ctx_mask=explicit))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    cut = pos >= W  # [A, BS]: the row loses context position 0 (every anchor here is > 0)
    if layers == 2:
        cut = cut.any(1, keepdim=True).expand(-1, BS)
    diff = (got - block_logits(full, aux, blocks))[0].abs().amax(-1)  # [A, BS-1]
    assert torch.all(diff[~cut[:, 1:]] == 0) and torch.all(diff[cut[:, 1:]] > 1e-6), diff
    assert cut[:, 1:].any() and (~cut[:, 1:]).any()


def test_dflash_training_and_drafter_agree_under_the_window(tiny_target):
    ids, anchor = _seq(), 12
    win, full = _dflash(tiny_target, BS), _dflash(tiny_target, None)
    aux = _dflash_aux(tiny_target, win, ids)
    train = block_logits(win, aux, _dflash_blocks(win, ids, [anchor]))[0, 0]  # [BS-1, V]
    drafted = _dflash_drafter_logits(tiny_target, win, ids, anchor)
    torch.testing.assert_close(drafted, train, rtol=0, atol=1e-5)
    assert (drafted - _dflash_drafter_logits(tiny_target, full, ids, anchor)).abs().max() > 1e-4


def test_dflash_config_checks_and_reads_the_window(tiny_target):
    c = _dflash(tiny_target, None).config
    old = c.to_dict()
    assert "sliding_window" not in old  # a draft without the window keeps the dict it always had
    assert DFlashConfig.from_dict(old).sliding_window is None
    assert DFlashConfig.from_dict({**old, "sliding_window": 9}).to_dict()["sliding_window"] == 9
    with pytest.raises(ValueError, match="shorter than the block"):
        dataclasses.replace(c, sliding_window=BS - 1)
    with pytest.raises(ValueError, match="positive integer"):
        dataclasses.replace(c, sliding_window=0)


@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark"])
def test_block_family_windowed_random_draft_decodes_greedily_as_the_target(tiny_target, name):
    """Every block method takes ``draft.sliding_window`` from its config (DFlash2 and DSpark through DFlash's)."""
    assert MethodSpec.from_name(name).cfg.draft.sliding_window is None
    spec = MethodSpec.from_name(name, ["method.draft.sliding_window=8"], ci=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draft = spec.build_draft(tiny_target, None)
    assert draft.config.sliding_window == 8 and draft.config.block_size <= 8
    prompt, cfg = TRAIN_PROMPTS[0], GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
    out, stats = speculative_generate(tiny_target, prompt, spec.build_drafter(draft), cfg)
    assert out == ref and stats.rounds > 1


def _dflash_export_pair(tiny_target, tmp_path):
    full, win = _dflash(tiny_target, None, layers=2), _dflash(tiny_target, 6, layers=2)
    return (dflash_export.save(full, tmp_path / "full", target=tiny_target),
            dflash_export.save(win, tmp_path / "win", target=tiny_target), win)


def test_dflash_export_writes_and_reads_the_window(tiny_target, tmp_path):
    full_dir, win_dir, win = _dflash_export_pair(tiny_target, tmp_path)
    cfg = json.loads((win_dir / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 6
    assert cfg["use_sliding_window"] is True and cfg["max_window_layers"] == 0 and cfg["is_causal"] is False
    assert cfg["draftlab"]["dflash_config"]["sliding_window"] == 6
    assert dflash_export.validate(win_dir, target=tiny_target) == []
    loaded = dflash_export.load(win_dir, target=tiny_target)
    assert loaded.config == win.config
    ids = _seq()
    blocks, aux = _dflash_blocks(win, ids, [3, 12]), _dflash_aux(tiny_target, win, ids)
    torch.testing.assert_close(block_logits(loaded, aux, blocks), block_logits(win, aux, blocks), rtol=0, atol=0)
    # A plain config (no draftlab block) reads the window from the keys vLLM reads.
    plain_dir = dflash_export.save(win, tmp_path / "plain", target=tiny_target)
    edit_config(plain_dir, lambda c: c.pop("draftlab"))
    assert dflash_export.load(plain_dir, target=tiny_target).config.sliding_window == 6

    # A draft without the window exports what it always did: the windowed config minus exactly the window keys.
    text = (full_dir / "config.json").read_text()
    assert '"sliding_window"' not in text and "max_window_layers" not in text
    cfg["layer_types"], cfg["use_sliding_window"] = ["full_attention"] * 2, False
    for key in ("sliding_window", "max_window_layers"):
        del cfg[key]
    del cfg["draftlab"]["dflash_config"]["sliding_window"]
    assert json.dumps(cfg, indent=2) + "\n" == text


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(is_causal=True), "is_causal"),
    (lambda c: c.update(sliding_window=9), "window of 9"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "mixes sliding and full"),
    (lambda c: c.update(use_sliding_window=False), "use_sliding_window"),
    (lambda c: c.update(layer_types=["full_attention"] * 2), "window of None"),
])
def test_dflash_export_with_wrong_window_keys_fails_validation(tiny_target, tmp_path, edit, message):
    win_dir = _dflash_export_pair(tiny_target, tmp_path)[1]
    edit_config(win_dir, edit)
    problems = dflash_export.validate(win_dir, target=tiny_target)
    assert any(message in p for p in problems), problems


# ------------------------------------------------------------------------------------------------------
# EAGLE-3: the TTT kernel


def _ttt_case(T=23, steps=2, padded=False, rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, hd = 2, 4, 2, 8
    M = T if rows is None else len(rows)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    key_mask = None
    if padded:
        key_mask = torch.ones(B, T, dtype=torch.bool)
        key_mask[1, 3:5] = False  # two padded keys inside the second sample
    return (r(B, H, M, hd), r(B, Hkv, T, hd), r(B, Hkv, T, hd), [r(B, Hkv, M, hd) for _ in range(steps)],
            [r(B, Hkv, M, hd) for _ in range(steps)], key_mask, None if rows is None else torch.tensor(rows))


def _explicit_ttt_mask(T, steps, window, key_mask, rows):
    """bool ``[B|1, M, T + steps * M]`` over keys ``[step 0 | step 1 | ..]``: row m of step k stands at rows[m] + k and
    sees step-0 keys ``rows[m] + k - W < s <= rows[m]`` and its own key of step j iff ``k - j < W``."""
    rows = torch.arange(T) if rows is None else rows
    s = torch.arange(T)
    prefix = (s <= rows[:, None]) & (s > rows[:, None] + steps - window)  # [M, T]
    prefix = prefix[None] if key_mask is None else prefix[None] & key_mask[:, None, :]
    eye = torch.eye(len(rows), dtype=torch.bool)
    later = [eye if steps - j < window else torch.zeros_like(eye) for j in range(1, steps + 1)]
    return torch.cat([prefix, *[x[None].expand(prefix.shape[0], -1, -1) for x in later]], dim=-1)


def _leaves(case, grad: bool = True):
    q, k0, v0, dk, dv = case[:5]
    return [t.clone().requires_grad_(grad) for t in (q, k0, v0, *dk, *dv)]


def _kernel_run(case, impl, window, grad: bool = True, **kw):
    leaves = _leaves(case, grad)
    n = len(case[3])
    out = kernel.ttt_attention(*leaves[:3], leaves[3:3 + n], leaves[3 + n:], 0.3, rows=case[6], key_mask=case[5],
                               impl=impl, window=window, **kw)
    return out, leaves


def _brute_force(case, window):
    q, k0, v0, dk, dv, key_mask, rows = case
    leaves = _leaves(case)
    n = len(dk)
    mask = _explicit_ttt_mask(k0.shape[2], n, window, key_mask, rows)
    keys = torch.cat([leaves[1], *leaves[3:3 + n]], dim=2)
    values = torch.cat([leaves[2], *leaves[3 + n:]], dim=2)
    return masked_attention(leaves[0], keys, values, mask, 0.3), leaves


def _grads(out, leaves, seed=1):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.parametrize("impl", ["torch", "blockwise"])
@pytest.mark.parametrize("steps", [0, 1, 2])
def test_ttt_window_over_the_whole_sequence_changes_nothing(impl, steps):
    case = _ttt_case(steps=steps, padded=True)
    kw = {"block": 8} if impl == "blockwise" else {}
    full, full_leaves = _kernel_run(case, impl, None, **kw)
    wide, wide_leaves = _kernel_run(case, impl, 23 + steps, **kw)
    assert torch.equal(wide, full)
    assert all(torch.equal(a, b) for a, b in zip(_grads(wide, wide_leaves), _grads(full, full_leaves)))


@pytest.mark.parametrize("impl", ["torch", "blockwise", "flex"])
@pytest.mark.parametrize("steps", [0, 1, 2])
@pytest.mark.parametrize("window, padded, rows", [(1, False, None), (3, True, None), (6, True, None),
                                                  (4, False, [3, 0, 20, 22, 7, 7])])
def test_ttt_small_window_is_the_explicit_mask(impl, steps, window, padded, rows):
    """Each implementation equals attention over the concatenated keys under the explicit windowed mask (forward
    and, but for flex, which has no CPU backward, gradients), and changes exactly the rows whose window cuts a key
    (row t of step k loses key 0 iff t + k >= W)."""
    case = _ttt_case(steps=steps, padded=padded, rows=rows)
    want, want_leaves = _brute_force(case, window)
    kw = {"block": 8} if impl == "blockwise" else {}
    if impl == "flex":
        got = _kernel_run(case, impl, window, grad=False)[0]  # no CPU backward in this torch
        torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-9)
        return
    got, leaves = _kernel_run(case, impl, window, **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(got, leaves), _grads(want, want_leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    row_pos = (torch.arange(23) if rows is None else torch.tensor(rows)) + steps
    cut = row_pos >= window  # [M]: key 0 (never padded here) falls out of the row's window
    diff = (got - _kernel_run(case, impl, None, **kw)[0]).abs().amax((0, 1, 3))  # [M]
    assert torch.all(diff[~cut] == 0) and torch.all(diff[cut] > 0), (cut, diff)


def test_ttt_naive_reference_takes_the_window():
    case = _ttt_case(steps=2, padded=True)
    q, k0, v0, dk, dv, key_mask, _ = case
    got = naive_ttt_attention(q, [k0, *dk], [v0, *dv], key_mask, 0.3, window=2)
    torch.testing.assert_close(got, _brute_force(case, 2)[0].detach(), rtol=1e-12, atol=1e-12)


def test_triton_refuses_the_window_and_auto_picks_blockwise():
    case = _ttt_case(steps=1)
    with pytest.raises(NotImplementedError, match="torch, blockwise, flex"):
        _kernel_run(case, "triton", 3)
    with torch.no_grad():
        assert torch.equal(_kernel_run(case, "auto", 3)[0], _kernel_run(case, "blockwise", 3)[0])


# ------------------------------------------------------------------------------------------------------
# EAGLE-3: the draft, training and the drafter


def _eagle3(target, window, seed: int = 0) -> Eagle3Draft:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Eagle3Draft.from_target(target, draft_vocab_size=256, sliding_window=window)


def _eagle3_features(target, ids):
    out = target.forward(ids, request=PassRequest(aux=True))
    return out.aux_hidden  # [1, T, 3*d_t]


def _ttt_steps(draft, ids, aux, impl: str, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(states, logits)`` of TTT steps 0..steps-1, as ``ttt.ttt_forward`` unrolls them: row t of step k consumes
    ``x_{t+k+1}`` and its own step k-1 state, at position t + k."""
    T = ids.shape[1]
    attention, hidden, out = TTTAttention(None, impl=impl), aux, []
    with torch.no_grad():
        for k in range(steps):
            ids_k = torch.zeros_like(ids)
            ids_k[:, : T - k - 1] = ids[:, k + 1:]
            hidden, logits = draft.forward_step(ids_k, hidden, torch.arange(T) + k, attention)
            out.append((hidden, logits))
    return out


@pytest.mark.parametrize("impl", ["torch", "blockwise"])
def test_eagle3_window_over_the_whole_sequence_changes_nothing(tiny_target, impl):
    ids = _seq()
    aux = _eagle3_features(tiny_target, ids)
    full, wide = _eagle3(tiny_target, None), _eagle3(tiny_target, ids.shape[1] + 3)
    for (_, a), (_, b) in zip(_ttt_steps(full, ids, aux, impl), _ttt_steps(wide, ids, aux, impl)):
        assert torch.equal(a, b)
    state = DecodeState(target=tiny_target, cache=None, tokens=ids[0].tolist(), prompt_len=ids.shape[1] - 1,
                        temperature=0.0, accepted_aux=aux[0, :-1])
    trees = []
    for draft in (full, wide):
        drafter = Eagle3Drafter(draft, branching=3, depth=4, nodes=10)
        drafter.reset(state)
        trees.append(drafter.propose(state))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)


@pytest.mark.parametrize("impl", ["torch", "blockwise", "naive"])
def test_eagle3_small_window_matches_the_brute_force_and_cuts_the_right_rows(tiny_target, impl):
    """TTT steps 0..2 of a windowed draft: step 0 equals a plain windowed causal pass, every step the brute-force
    TTT attention (``naive``: concatenated keys under the explicit mask); a row changes iff t + k >= W."""
    W, ids = 5, _seq()
    aux = _eagle3_features(tiny_target, ids)
    win, full = _eagle3(tiny_target, W), _eagle3(tiny_target, None)
    got = _ttt_steps(win, ids, aux, impl)
    with torch.no_grad():
        causal = win.forward_step(torch.cat([ids[:, 1:], ids[:, :1] * 0], 1), aux, torch.arange(ids.shape[1]),
                                  CausalAttention())[1]
    torch.testing.assert_close(got[0][1], causal, rtol=0, atol=1e-5)
    for (_, a), (_, b) in zip(got, _ttt_steps(win, ids, aux, "naive")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for k, ((_, a), (_, b)) in enumerate(zip(got, _ttt_steps(full, ids, aux, impl))):
        cut = torch.arange(ids.shape[1]) + k >= W
        diff = (a - b)[0].abs().amax(-1)  # [T]
        assert torch.all(diff[~cut] < 1e-6) and torch.all(diff[cut] > 1e-4), (k, diff)


@pytest.mark.parametrize("impl", ["torch", "blockwise"])
def test_eagle3_drafter_rows_equal_the_ttt_steps_under_the_window(tiny_target, impl):
    """The drafter's root row and two tree levels along the sequence's own tokens (``DraftRows``, whose cache grows
    on the way; a sibling at depth 1 puts the depth-2 row at a cache slot past its position) equal TTT steps 0, 1,
    2 of the root's row."""
    W, ids, n = 3, _seq(), 14
    aux = _eagle3_features(tiny_target, ids)
    draft = _eagle3(tiny_target, W)
    ttt = [torch.log_softmax(logits[0], -1) for _, logits in _ttt_steps(draft, ids, aux, impl)]  # [T, V_d] per step
    seq, r = ids[0].tolist(), n - 2  # the prompt seq[:n]; row r consumes the root seq[n - 1]
    rows = DraftRows(draft, chunk=1)
    with torch.no_grad():
        rows.start(n - 1)
        rows.append(seq[1:n], aux[0, : n - 1])
        torch.testing.assert_close(rows.root_draft_logprobs, ttt[0][r], rtol=0, atol=1e-5)
        c = rows.committed
        # depth 1: the sequence's token and a sibling, both at position r + 1 (slots c, c + 1)
        mask = torch.zeros(2, c + 2, dtype=torch.bool)
        mask[:, :c], mask[0, c], mask[1, c + 1] = True, True, True
        h, logp = rows.step(torch.tensor([seq[n], 7]), rows.h_last.expand(2, -1), torch.tensor([r + 1] * 2), mask)
        rows.cache.commit(2)
        torch.testing.assert_close(logp[0], ttt[1][r], rtol=0, atol=1e-5)
        # depth 2 under the first: position r + 2 at slot c + 2, seeing the committed rows, its parent and itself
        mask = torch.zeros(1, c + 3, dtype=torch.bool)
        mask[0, :c + 1], mask[0, c + 2] = True, True
        _, logp = rows.step(torch.tensor([seq[n + 1]]), h[:1], torch.tensor([r + 2]), mask)
        torch.testing.assert_close(logp[0], ttt[2][r], rtol=0, atol=1e-5)
        assert rows.slot_positions[c:c + 3].tolist() == [r + 1, r + 1, r + 2]
        rows.rollback()


def test_eagle3_windowed_random_draft_decodes_greedily_as_the_target(tiny_target):
    prompt, cfg = TRAIN_PROMPTS[0], GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
    drafter = Eagle3Drafter(_eagle3(tiny_target, 3), branching=3, depth=4, nodes=10)
    drafter.cache_chunk = 2  # the draft cache (and its positions) grows several times
    out, stats = speculative_generate(tiny_target, prompt, drafter, cfg)
    assert out == ref and stats.rounds > 1


def test_eagle3_refuses_an_attention_that_ignores_the_window(tiny_target):
    class Unwindowed(CausalAttention):
        def __call__(self, layer, q, k, v, scale):
            return super().__call__(layer, q, k, v, scale)

    ids = _seq(6)
    with pytest.raises(ValueError, match="Unwindowed applies no sliding window"):
        _eagle3(tiny_target, 3).forward_step(ids, _eagle3_features(tiny_target, ids), torch.arange(6), Unwindowed())
    _eagle3(tiny_target, None).forward_step(ids, _eagle3_features(tiny_target, ids), torch.arange(6), Unwindowed())


def test_eagle3_config_reads_old_dicts_and_checks_the_window():
    old = tiny_draft().config.to_dict()
    assert "sliding_window" not in old and Eagle3Config.from_dict(old).sliding_window is None
    assert Eagle3Config.from_dict({**old, "sliding_window": 4}).to_dict()["sliding_window"] == 4
    with pytest.raises(ValueError, match="positive integer"):
        Eagle3Config.from_dict({**old, "sliding_window": -1})


# ------------------------------------------------------------------------------------------------------
# EAGLE-3: exports

_SAVE = {"sglang": (save_sglang, validate_sglang, load_native), "vllm": (save_vllm, validate_vllm, load_native),
         "speculators": (save_speculators, validate_speculators, load_speculators)}


def _layer_cfg(cfg: dict, fmt: str) -> dict:
    return cfg["transformer_layer_config"] if fmt == "speculators" else cfg


@pytest.mark.parametrize("fmt", list(_SAVE))
def test_eagle3_exports_write_and_read_the_window(fmt, tmp_path):
    save, validate, load = _SAVE[fmt]
    win, full = tiny_draft(sliding_window=5), tiny_draft()
    out = save(win, tmp_path / "win", include_embedding=True, max_position_embeddings=64)
    cfg = json.loads((out / "config.json").read_text())
    layer = _layer_cfg(cfg, fmt)
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 5
    assert layer["use_sliding_window"] is True
    assert validate(out) == []
    loaded = load(out)
    assert loaded.config.sliding_window == 5
    for a, b in zip(draft_outputs(loaded), draft_outputs(win)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(not torch.equal(a, b) for a, b in zip(draft_outputs(win), draft_outputs(full)))

    plain = save(full, tmp_path / "full", include_embedding=True, max_position_embeddings=64)
    text = (plain / "config.json").read_text()
    assert "sliding" not in text and "layer_types" not in text  # no new keys without the window
    layer.pop("layer_types"), layer.pop("use_sliding_window"), layer.pop("sliding_window")
    if "draftlab" in cfg:
        cfg["draftlab"]["eagle3_config"].pop("sliding_window")
    assert json.dumps(cfg, indent=2) + "\n" == text


@pytest.mark.parametrize("fmt", list(_SAVE))
def test_eagle3_export_with_wrong_window_keys_fails(fmt, tmp_path):
    save, validate, _ = _SAVE[fmt]
    out = save(tiny_draft(sliding_window=5), tmp_path / "win", max_position_embeddings=64)
    edit_config(out, lambda c: _layer_cfg(c, fmt).update(layer_types=["sliding_attention", "full_attention"]))
    assert any("layer_types must list" in p for p in validate(out)), validate(out)
    if fmt != "speculators":  # the draftlab block names the draft's window
        edit_config(out, lambda c: c.update(layer_types=["full_attention"]))
        assert any("the draft has a sliding window of 5" in p for p in validate(out)), validate(out)


# ------------------------------------------------------------------------------------------------------
# configs and the training key


@pytest.mark.parametrize("name", ["dflash", "eagle3"])
def test_a_null_window_leaves_the_training_key_as_it_was(name):
    spec = MethodSpec.from_name(name)
    assert spec.cfg.draft.sliding_window is None and "sliding_window" not in spec.key_config()["draft"]
    windowed = MethodSpec.from_name(name, ["method.draft.sliding_window=16"])
    assert windowed.key_config()["draft"]["sliding_window"] == 16
