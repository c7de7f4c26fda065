"""The EAGLE-3 drafter in the shared engine: draft-cache reuse, frontier numerics, taps, sampling.

Greedy losslessness is checked for every method config by ``tests/decoding/conformance``.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import draftlab.methods.eagle3.drafter as drafter_module
from draftlab.data.vocab import build_vocab_mapping
from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.dynamic_tree import build_dynamic_tree
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.eagle3 import CacheAttention, Eagle3Draft, Eagle3Drafter, ttt_forward
from draftlab.targets.base import PassRequest
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT, train_sequences


@pytest.fixture(scope="module")
def trained(tiny_target):
    """A draft trained with TTT on the target's own greedy continuations of ``TRAIN_PROMPTS``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seqs = train_sequences(tiny_target)
        B, T, V = len(seqs), max(map(len, seqs)), tiny_target.geometry.vocab_size
        ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        attn = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
        loss_mask = torch.zeros(B, T)  # [B, T]
        aux = torch.zeros(B, T, 3 * tiny_target.geometry.hidden_size)  # [B, T, 3*d_t]
        logits = torch.zeros(B, T, V)  # [B, T, V]
        for i, (seq, prompt) in enumerate(zip(seqs, TRAIN_PROMPTS)):
            n = len(seq)
            ids[i, :n], attn[i, :n] = torch.tensor(seq), True
            # Row t predicts x_{t+2}: from the prompt's last row on, what the drafter proposes after a root.
            loss_mask[i, len(prompt) - 1:n] = 1
            out = tiny_target.forward(torch.tensor([seq]), request=PassRequest(aux=True))
            aux[i, :n], logits[i, :n] = out.aux_hidden[0], out.logits[0]
        freq = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V)
        mapping = build_vocab_mapping(freq, 256)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            draft = Eagle3Draft.from_target(tiny_target, vocab_mapping=mapping)
            opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=2e-2)
            for _ in range(25):
                out = ttt_forward(draft, ids, aux, logits, loss_mask, attn, ttt_length=4)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
        draft.eval()
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(draft=draft, refs={tuple(p): s[len(p):] for p, s in zip(TRAIN_PROMPTS, seqs)})


def _fresh_pass(draft, target, seq):
    """Causal draft forward over every row of ``seq`` with the target's features from one pass.

    Returns (projected features [1, n-1, d], output states [1, n-1, d], logits [1, n-1, V_d]).
    """
    out = target.forward(torch.tensor([seq[:-1]]), request=PassRequest(aux=True))
    g = draft.project(out.aux_hidden)  # [1, n-1, d]
    ids = torch.tensor([seq[1:]])  # [1, n-1]
    h, logits = draft.forward_step(ids, g, torch.arange(len(seq) - 1))  # [1, n-1, d], [1, n-1, V_d]
    return g, h, logits


# ---- 1. greedy losslessness: tests/decoding/conformance (every conf/method config, trained via the registry)


# ---- 2. the draft cache carried across rounds -----------------------------------------------------------


class _RecordingDrafter(Eagle3Drafter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.path_lengths = []

    def update(self, state, out):
        self.path_lengths.append(len(out.result.path))
        super().update(state, out)


@torch.no_grad()
def test_cached_rows_equal_a_fresh_forward(tiny_target, trained):
    prompt = TRAIN_PROMPTS[0]

    def run(budget: int):
        drafter = _RecordingDrafter(trained.draft, branching=1, depth=4, nodes=4)
        drafter.cache_chunk = 4  # several reallocations of the draft cache along the way
        out, stats = speculative_generate(tiny_target, prompt, drafter,
                                          GenerationConfig(max_new_tokens=budget, temperature=0, stop_on_eos=False))
        return drafter, out, stats

    # A budget that ends one token inside a round that accepted several, after at least four rounds (greedy: a
    # shorter budget replays the same rounds), whatever the trained draft accepts.
    lengths = run(48)[2].accept_lengths
    cut = next(i for i in range(3, len(lengths)) if lengths[i] > 1)
    drafter, out, stats = run(sum(lengths[:cut + 1]) - 1)
    seq = prompt + out
    assert stats.rounds >= 4 and max(stats.accept_lengths) > 1
    # The budget cut the last round short, so update saw fewer new tokens than the accepted path.
    assert stats.accept_lengths[-1] < drafter.path_lengths[-1], (stats.accept_lengths, drafter.path_lengths)
    assert drafter.cache.max_length > len(prompt) + 2 * drafter.cache_chunk
    L = len(seq) - 1
    assert drafter.num_committed == L and drafter.cache.length == L

    g, _, logits = _fresh_pass(trained.draft, tiny_target, seq)
    ids = trained.draft.target_ids()
    expected = torch.log_softmax(logits[0, -1], -1)  # [V_d]
    torch.testing.assert_close(drafter.root_logprobs[ids], expected, rtol=0, atol=1e-5)
    outside = torch.ones_like(drafter.root_logprobs, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(drafter.root_logprobs[outside]).all()
    # Every committed row, not only the last one: keys and values equal those of a single causal pass.
    fresh = trained.draft.new_cache(1, L)
    trained.draft.forward_step(torch.tensor([seq[1:]]), g, torch.arange(L), CacheAttention(fresh))
    torch.testing.assert_close(drafter.cache.k[..., :L, :], fresh.k, rtol=0, atol=1e-5)
    torch.testing.assert_close(drafter.cache.v[..., :L, :], fresh.v, rtol=0, atol=1e-5)


# ---- 3. frontier expansion ------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("full_vocab", [False, True])
def test_frontier_logprobs_equal_a_causal_pass_over_the_path(tiny_target, trained, monkeypatch, full_vocab):
    # An unseen context: the draft is unsure there, so frontiers mix children of different parents.
    prompt = UNSEEN_PROMPT
    drafter = Eagle3Drafter(trained.draft, branching=3, depth=4, nodes=20, full_vocab=full_vocab)
    out, _ = speculative_generate(tiny_target, prompt, drafter,
                                  GenerationConfig(max_new_tokens=12, temperature=0, stop_on_eos=False))
    seq = prompt + out
    calls, steps = [], []

    def recording(root, expand, **kwargs):
        def wrapped(batch):
            result = expand(batch)
            calls.append((batch, result))
            return result

        return build_dynamic_tree(root, wrapped, **kwargs)

    monkeypatch.setattr(drafter_module, "build_dynamic_tree", recording)
    step = drafter.rows.step

    def recording_step(*args, **kwargs):
        h, logp = step(*args, **kwargs)
        steps.append(logp.clone())
        return h, logp

    monkeypatch.setattr(drafter.rows, "step", recording_step)  # the fast path's passes ([F, V_d] log-probs)
    state = DecodeState(target=tiny_target, cache=None, tokens=list(seq), prompt_len=len(prompt),
                        temperature=0.0)
    tree = drafter.propose(state)
    L = len(seq) - 1
    assert tree.size == 21 and [b.depth for b, _ in calls] == [0, 1, 2, 3]
    assert drafter.num_committed == L and drafter.cache.length == L  # provisional rows dropped
    assert len(steps) == (0 if full_vocab else 3)

    token, parent = {0: seq[-1]}, {0: -1}
    for batch, _ in calls:
        for node, tok, par in zip(batch.node_ids.tolist(), batch.tokens.tolist(), batch.parents.tolist()):
            token[node], parent[node] = tok, par

    g, h, logits = _fresh_pass(trained.draft, tiny_target, seq)
    ids = trained.draft.target_ids()
    V_d = ids.numel()

    def draft_vocab_rows(level, result):
        """[F, V_d] log-probs the expansion at ``level`` chose from, checked against what it returned."""
        if full_vocab:  # log-probs over the target vocabulary, -inf outside the draft's
            assert result.shape[1] == tiny_target.geometry.vocab_size
            assert (torch.isneginf(result).sum(1) == result.shape[1] - V_d).all()
            return result[:, ids]
        logp = drafter.rows.root_draft_logprobs[None] if level == 0 else steps[level - 1]  # [F, V_d]
        # Top-k in the draft vocabulary, mapped to target ids only for the chosen candidates.
        values, top = torch.topk(logp, 3, dim=-1)
        torch.testing.assert_close(result.logprobs, values, rtol=0, atol=0)
        assert torch.equal(result.tokens, ids[top])
        return logp

    root = draft_vocab_rows(0, calls[0][1])[0]
    # The full-vocabulary view of the root row stays available (and -inf outside the draft vocabulary).
    torch.testing.assert_close(drafter.root_logprobs[ids], root, rtol=0, atol=0)
    assert torch.isneginf(drafter.root_logprobs).sum() == drafter.root_logprobs.numel() - V_d
    torch.testing.assert_close(root, torch.log_softmax(logits[0, -1], -1), rtol=0, atol=1e-5)
    checked, mixed = 0, False
    for level, (batch, result) in enumerate(calls[1:], start=1):
        logp = draft_vocab_rows(level, result)
        mixed |= len(set(batch.parents.tolist())) > 1
        for row, node in enumerate(batch.node_ids.tolist()):
            path = []
            while node != 0:
                path.append(token[node])
                node = parent[node]
            path.reverse()
            # Plain causal pass over committed rows + the path, the draft's own state fed back per step.
            row_ids, hidden, state_out = list(seq[1:]), g, h[:, -1:]
            for tok in path:
                row_ids.append(tok)
                hidden = torch.cat([hidden, state_out], 1)  # [1, L + k, d]
                positions = torch.arange(len(row_ids))  # committed rows 0..L-1, then L-1+k at depth k
                hs, lg = trained.draft.forward_step(torch.tensor([row_ids]), hidden, positions)
                state_out = hs[:, -1:]
            torch.testing.assert_close(logp[row], torch.log_softmax(lg[0, -1], -1), rtol=0, atol=1e-5)
            checked += 1
    assert checked == 9 and mixed


# ---- 4. incompatible drafts ----------------------------------------------------------------------------


def _fake_target(target, **changes):
    sizes = {k: v for k, v in changes.items() if k in ("hidden_size", "vocab_size")}
    return SimpleNamespace(geometry=replace(target.geometry, **sizes),
                           aux_layer_ids=changes.get("aux_layer_ids", target.aux_layer_ids),
                           layer_convention=changes.get("layer_convention", target.layer_convention))


def test_incompatible_draft_raises(tiny_target):
    base = Eagle3Drafter(Eagle3Draft.from_target(tiny_target, draft_vocab_size=64))
    base.check_compatible(tiny_target)
    # The same tensors named in the other convention are compatible.
    Eagle3Drafter(Eagle3Draft.from_target(tiny_target, draft_vocab_size=64, layer_convention="input_to")
                  ).check_compatible(tiny_target)
    assert tiny_target.aux_layer_ids == [0, 0, 1]
    # The target's default taps do not matter: the engine captures the draft's own (taps).
    base.check_compatible(_fake_target(tiny_target, aux_layer_ids=[0, 1, 1]))
    base.check_compatible(_fake_target(tiny_target, aux_layer_ids=[0, 1]))
    # output_of 1 (the last layer's output) has no name among a 2-layer target's input_to ids.
    with pytest.raises(ValueError, match="aux_layer_ids"):
        base.check_compatible(_fake_target(tiny_target, layer_convention="input_to"))
    with pytest.raises(ValueError, match="vocab_size"):
        base.check_compatible(_fake_target(tiny_target, vocab_size=1000))
    with pytest.raises(ValueError, match="hidden_size"):
        base.check_compatible(_fake_target(tiny_target, hidden_size=32))
    # Through the engine: reset checks before touching the draft.
    cfg = GenerationConfig(max_new_tokens=4, temperature=0)
    wrong_width = Eagle3Draft.from_target(tiny_target, draft_vocab_size=64, target_hidden_size=32)
    with pytest.raises(ValueError, match="target_hidden_size"):
        speculative_generate(tiny_target, [1, 2, 3], Eagle3Drafter(wrong_width), cfg)
    out_of_range = Eagle3Draft.from_target(tiny_target, draft_vocab_size=64, aux_layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="aux.layer.ids"):
        speculative_generate(tiny_target, [1, 2, 3], Eagle3Drafter(out_of_range), cfg)


class _TapRecorder(Eagle3Drafter):
    def reset(self, state):
        self.prefill_aux = state.accepted_aux.clone()
        super().reset(state)

    def update(self, state, out):
        self.round_aux = out.aux.clone()
        self.round_tokens = out.tree.tokens.clone()
        super().update(state, out)


@torch.no_grad()
def test_engine_captures_the_drafts_taps_not_the_targets(tiny_target):
    """A draft trained on other layers than the target's default taps gets exactly its own layers."""
    taps = [0, 1, 1]
    assert tiny_target.aux_layer_ids != taps
    drafter = _TapRecorder(Eagle3Draft.from_target(tiny_target, draft_vocab_size=64, aux_layer_ids=taps),
                           branching=2, depth=2, nodes=3)
    assert drafter.taps(tiny_target) == taps
    prompt = [5, 6, 7, 8, 9, 10]
    out, _ = speculative_generate(tiny_target, prompt, drafter, GenerationConfig(max_new_tokens=2, stop_on_eos=False))
    ref = tiny_target.forward(torch.tensor([prompt]), request=PassRequest(aux=taps)).aux_hidden[0]
    torch.testing.assert_close(drafter.prefill_aux, ref, rtol=0, atol=1e-5)
    default = tiny_target.forward(torch.tensor([prompt]), request=PassRequest(aux=True)).aux_hidden[0]
    assert not torch.allclose(drafter.prefill_aux, default, atol=1e-3)
    # The verify pass taps the same layers: the root row's aux is the next position's features.
    seq = prompt + out[:1]
    ref = tiny_target.forward(torch.tensor([seq]), request=PassRequest(aux=taps)).aux_hidden[0, -1]
    assert int(drafter.round_tokens[0]) == seq[-1]
    torch.testing.assert_close(drafter.round_aux[0], ref, rtol=0, atol=1e-4)


# ---- 5. sampling ---------------------------------------------------------------------------------------


def test_sampling_runs_and_emits_valid_tokens(tiny_target, trained):
    drafter = Eagle3Drafter(trained.draft, branching=4, depth=4, nodes=16)
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.7, seed=3, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, TRAIN_PROMPTS[2], drafter, cfg)
    again, _ = speculative_generate(tiny_target, TRAIN_PROMPTS[2], drafter, cfg)
    assert len(out) == 16 and out == again
    assert all(0 <= t < tiny_target.geometry.vocab_size for t in out)
    assert sum(stats.accept_lengths) == len(out) - 1 and min(stats.tree_sizes) == 17
