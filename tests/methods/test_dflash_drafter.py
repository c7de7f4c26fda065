"""The DFlash drafter in the shared engine: greedy losslessness, training/inference agreement, sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.sampling import logits_to_probs
from draftlab.methods.dflash import DFlashDrafter, build_draft
from draftlab.methods.dflash.blocks import block_logits, block_loss, make_blocks
from draftlab.targets.base import PassRequest
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT, train_sequences

BS = 4
N_DRAWS = 200  # draws of the sampled block from one state: ~3 s on one core


def _aux(target, draft, ids):
    return target.forward(ids, request=PassRequest(aux=draft.taps(target), logits_rows=torch.arange(0))).aux_hidden  # [B, T, n_taps*d]


@pytest.fixture(scope="module")
def trained(tiny_target):
    """A DFlash draft trained on the target's own greedy continuation of ``TRAIN_PROMPTS[0]``.

    One sequence keeps it to a few seconds: every step runs the target's 49k-row LM head over each slot.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seqs = train_sequences(tiny_target)[:1]
        B, T = len(seqs), max(map(len, seqs))
        ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        attn = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        for i, (seq, prompt) in enumerate(zip(seqs, TRAIN_PROMPTS)):
            ids[i, :len(seq)], attn[i, :len(seq)] = torch.tensor(seq), 1
            loss_mask[i, len(prompt):len(seq)] = 1
        draft = build_draft(tiny_target, num_layers=1, block_size=BS, seed=0)
        aux = _aux(tiny_target, draft, ids)
        opt = torch.optim.Adam(draft.parameters(), lr=2e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(30):
            blocks = make_blocks(ids, loss_mask, attn, block_size=BS, mask_token_id=draft.config.mask_token_id,
                                 num_anchors=64, generator=gen)
            loss = block_loss(block_logits(draft, aux, blocks), blocks, gamma=2.0).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        draft.eval()
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(draft=draft, seqs=seqs)


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_output_equals_autoregressive(tiny_target, trained, which):
    draft = trained.draft if which == "trained" else build_draft(tiny_target, num_layers=1, block_size=BS, seed=3)
    taus = []
    for prompt, n in [(TRAIN_PROMPTS[0], 40), (TRAIN_PROMPTS[1], 23), (UNSEEN_PROMPT, 17)]:
        cfg = GenerationConfig(max_new_tokens=n, stop_on_eos=False)
        ref, _ = autoregressive_generate(tiny_target, prompt, cfg)
        out, stats = speculative_generate(tiny_target, prompt, DFlashDrafter(draft), cfg)
        assert out == ref
        assert all(1 <= a <= BS for a in stats.accept_lengths) and set(stats.tree_sizes) == {BS}
        taus.append(stats.tau)
    if which == "trained":
        assert taus[0] > 1.5, taus  # it drafts what it learned, so the engine accepts whole blocks


def test_stops_at_eos_and_budget_like_autoregressive(tiny_target, trained):
    prompt = TRAIN_PROMPTS[2]
    ref, _ = autoregressive_generate(tiny_target, prompt, GenerationConfig(max_new_tokens=30, stop_on_eos=False))
    eos = ref[9]  # pretend a token mid-continuation is EOS: the round that reaches it is cut there
    orig = tiny_target.eos_token_ids
    tiny_target.eos_token_ids = [eos]
    try:
        cfg = GenerationConfig(max_new_tokens=30)
        a, _ = autoregressive_generate(tiny_target, prompt, cfg)
        s, _ = speculative_generate(tiny_target, prompt, DFlashDrafter(trained.draft), cfg)
    finally:
        tiny_target.eos_token_ids = orig
    assert s == a and a[-1] == eos


def _state(target, draft, seq, anchor, temperature=0.0):
    aux = _aux(target, draft, torch.tensor([seq[:anchor]]))[0]  # [anchor, n_taps*d]
    return DecodeState(target=target, cache=None, tokens=list(seq[:anchor + 1]), prompt_len=anchor,
                       temperature=temperature, accepted_aux=aux, generator=torch.Generator().manual_seed(0))


def test_inference_block_equals_the_training_block(tiny_target, trained):
    draft, seq = trained.draft, trained.seqs[0]
    anchor = len(TRAIN_PROMPTS[0]) + 5
    ids = torch.tensor([seq])
    ones = torch.ones_like(ids)
    blocks = make_blocks(ids, ones, ones, block_size=BS, mask_token_id=draft.config.mask_token_id,
                         anchors=torch.tensor([[anchor]]))
    train_logits = block_logits(draft, _aux(tiny_target, draft, ids), blocks)[0, 0]  # [BS-1, V]
    drafter = DFlashDrafter(draft)
    state = _state(tiny_target, draft, seq, anchor)
    drafter.reset(state)
    tree = drafter.propose(state)
    assert tree.tokens.tolist() == [seq[anchor]] + train_logits.argmax(-1).tolist()
    assert tree.deterministic and tree.parents.tolist() == [-1, 0, 1, 2]
    # At T = 1 the reported draft distribution is the training-time softmax, row by row.
    state = _state(tiny_target, draft, seq, anchor, temperature=1.0)
    drafter.reset(state)
    tree = drafter.propose(state)
    assert not tree.deterministic and tree.draft_probs.shape == (BS, tiny_target.geometry.vocab_size)
    assert torch.allclose(tree.draft_probs[1:], torch.softmax(train_logits.float(), -1), atol=1e-5)
    picked = tree.draft_probs[1:].gather(1, tree.tokens[1:, None]).squeeze(1)
    assert (picked > 0).all()  # each proposal was drawn from the row reported for it


def test_sampled_chain_draws_from_the_q_it_reports_and_argmax_mode_takes_its_mode(tiny_target, trained):
    draft, seq = trained.draft, trained.seqs[0]
    anchor, t, top_k, top_p = 20, 1.5, 12, 0.95
    # The block's logits through the training path, independent of the drafter's own block pass.
    ids = torch.tensor([seq])
    ones = torch.ones_like(ids)
    blocks = make_blocks(ids, ones, ones, block_size=BS, mask_token_id=draft.config.mask_token_id,
                         anchors=torch.tensor([[anchor]]))
    with torch.no_grad():
        logits = block_logits(draft, _aux(tiny_target, draft, ids), blocks)[0, 0]  # [BS-1, V]
    q = logits_to_probs(logits, t, top_k, top_p)  # [BS-1, V]

    state = _state(tiny_target, draft, seq, anchor, temperature=t)
    state.top_k, state.top_p = top_k, top_p
    greedy = DFlashDrafter(draft, sampling="argmax")
    greedy.reset(state)
    tree = greedy.propose(state)
    assert tree.deterministic and tree.draft_probs is None
    assert tree.tokens[1:].tolist() == logits.argmax(-1).tolist()

    drafter = DFlashDrafter(draft)  # sampling="sample", tree: fixed
    drafter.reset(state)
    draws = []
    for seed in range(N_DRAWS):
        state.generator = torch.Generator().manual_seed(seed)
        tree = drafter.propose(state)
        if seed == 0:
            assert not tree.deterministic and tree.parents.tolist() == [-1, 0, 1, 2]
            # Each row is the sampling distribution of its slot, at the target's temperature, top-k and top-p.
            torch.testing.assert_close(tree.draft_probs[1:].float(), q, atol=1e-5, rtol=0)
        draws.append(tree.tokens[1:])
    state.generator = torch.Generator().manual_seed(0)
    assert torch.equal(drafter.propose(state).tokens[1:], draws[0])  # a seed fixes the draw
    draws = torch.stack(draws)  # [N_DRAWS, BS-1]
    assert bool((q.gather(1, draws.T) > 0).all()), "a drawn token has q(x) = 0"
    # Every slot's token frequencies match its reported q: one chi-square over all slots' bins, one degree of
    # freedom lost per slot. A bin is a token expecting >= 5 draws; the slot's other tokens form one more bin,
    # or join the smallest one when together they expect fewer than 5 (a tiny expectation would dominate).
    obs, exp = [], []
    for slot in range(BS - 1):
        counts = torch.bincount(draws[:, slot], minlength=q.shape[1]).double()  # [V]
        e = N_DRAWS * q[slot].double() / q[slot].double().sum()  # [V]
        big = e >= 5
        o_s, e_s = counts[big].tolist(), e[big].tolist()
        rest_o, rest_e = float(counts[~big].sum()), float(e[~big].sum())
        if rest_e >= 5:
            o_s, e_s = o_s + [rest_o], e_s + [rest_e]
        elif o_s:
            o_s[-1], e_s[-1] = o_s[-1] + rest_o, e_s[-1] + rest_e
        obs, exp = obs + o_s, exp + e_s
    p = chisquare(obs, exp, ddof=BS - 2).pvalue
    assert p > 1e-4, f"draws do not follow the reported q: p = {p:.2e}"


def test_rejects_a_block_longer_than_trained(trained):
    with pytest.raises(ValueError, match="trained block"):
        DFlashDrafter(trained.draft, block_size=BS + 1)
