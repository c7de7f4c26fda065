"""Draft-OPD: anchors from a hand-worked stub round, replay equal to what the drafter proposed, the objective
against hand-computed values, and rollout / replay phases through the module (resume included)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.tree import DraftTree
from draftlab.methods.confu.drafter import ConFuDrafter
from draftlab.methods.confu.replay import ConFuReplay
from draftlab.methods.dflash.drafter import DFlashDrafter
from draftlab.methods.dflash.replay import DFlashReplay
from draftlab.methods.draft_opd.anchors import chain_nodes, trace_anchors
from draftlab.methods.draft_opd.objective import Objective, ReplayBatch
from draftlab.methods.draft_opd.rollout import prompt_of, rollout
from draftlab.methods.eagle3.drafter import Eagle3Drafter
from draftlab.methods.eagle3.replay import Eagle3Replay
from tests.decoding.test_engine_stub import CYCLE, FixedDrafter
from tests.methods.corpus import TRAIN_PROMPTS
from tests.stubs import TableTarget

# ---- anchors from a hand-worked tree round --------------------------------------------------------------


def _round_tree(r):
    # root r -> {a (node 1, right), x (node 2, wrong)}; a -> {y (node 3), z (node 4)}, both wrong;
    # y -> w (node 5). The target accepts a, rejects y and z (a's children): r = 1.
    a = CYCLE[r]
    wrong = [t for t in range(1, 10) if t != CYCLE[a] and t != a][:4]
    x, y, z, w = wrong
    return DraftTree.from_parents([r, a, x, y, z, w], [-1, 0, 0, 1, 1, 3])


def test_anchor_of_a_hand_worked_tree_round():
    target = TableTarget(CYCLE)
    prompt = [0, 5, 6]
    out, stats = speculative_generate(target, prompt, FixedDrafter(_round_tree),
                                      GenerationConfig(max_new_tokens=7, stop_on_eos=False), trace=True)
    assert out == [7, 8, 9, 1, 2, 3, 4]  # lossless: the target's own cycle
    first = stats.trace[0]
    r, a = 7, 8
    tree = _round_tree(r)
    x, y, z, w = tree.tokens[2:].tolist()
    # By hand: path root -> node 1; nodes 3 and 4 (a's children) rejected; the chain continues under node 3.
    assert first.path == [0, 1] and sorted(first.rejected) == [3, 4]
    assert chain_nodes(first) == [0, 1, 3, 5]
    assert chain_nodes(first, rejected_suffix=False) == [0, 1, 3]
    anchors = trace_anchors(stats.trace)
    assert len(anchors) == stats.rounds
    anchor = anchors[0]
    assert anchor.root == len(prompt)  # the root (7, the prefill's token) sits right after the prompt
    assert anchor.chain.tolist() == [a, y, w] and anchor.accepted == 1
    assert sorted(anchor.rejected) == sorted([y, z]) and anchor.committed == CYCLE[a]
    # Target log-probs: chain position k reads the verify row of chain node k-1 (root, a, y).
    expected = torch.log_softmax(target.table[torch.tensor([r, a, y])], -1)
    torch.testing.assert_close(anchor.target_logprobs, expected)
    torch.testing.assert_close(anchor.target_logprobs, first.target_logprobs[[0, 1, 3]])
    # The next round's root is the previous one's committed token, one position further than its path.
    assert anchors[1].root == anchor.root + 2
    # Restricting to a draft vocabulary keeps those columns of the same rows.
    vocab = torch.tensor([1, 4, 9])
    sub = trace_anchors(stats.trace[:1], vocab_ids=vocab)[0]
    torch.testing.assert_close(sub.target_logprobs, expected[:, vocab])


def test_fully_accepted_and_root_only_rounds():
    target = TableTarget(CYCLE)
    chain = FixedDrafter(lambda r: DraftTree.chain(r, [CYCLE[r], CYCLE[CYCLE[r]]]))
    _, stats = speculative_generate(target, [0], chain, GenerationConfig(max_new_tokens=6, stop_on_eos=False),
                                    trace=True)
    a = trace_anchors(stats.trace)[0]
    assert a.accepted == a.length == 2 and a.rejected == []
    root_only = FixedDrafter(lambda r: DraftTree.chain(r, []))
    _, stats = speculative_generate(target, [0], root_only, GenerationConfig(max_new_tokens=4, stop_on_eos=False),
                                    trace=True)
    assert stats.rounds == 3 and trace_anchors(stats.trace) == []  # nothing proposed, nothing to replay


def test_rollout_counts_every_prompt():
    target = TableTarget(CYCLE)
    drafter = FixedDrafter(_round_tree)
    prompts = [[0, 5], [], list(range(1, 10)) * 3, [3]]
    out, report = rollout(target, drafter, prompts, GenerationConfig(max_new_tokens=5, stop_on_eos=False),
                          vocab_ids=None, max_prompt_tokens=16)
    assert (report.prompts, report.success, report.skipped, report.error) == (4, 2, 2, 0)
    assert [r.prompt_len for r in out] == [2, 1] and all(r.new_tokens == 5 for r in out)
    assert report.tau == pytest.approx((10 - 2) / report.rounds)

    class Broken(FixedDrafter):
        def propose(self, state):
            raise RuntimeError("draft exploded")

    _, report = rollout(target, Broken(_round_tree), [[0, 5]], GenerationConfig(max_new_tokens=5), vocab_ids=None)
    assert (report.success, report.error) == (0, 1) and "draft exploded" in report.errors[0]


def test_prompt_of_cuts_at_the_first_trained_token():
    ids = torch.tensor([5, 6, 7, 8, 9, 0])
    mask = torch.tensor([0, 0, 0, 1, 1, 0])
    assert prompt_of(ids, mask, torch.tensor([1, 1, 1, 1, 1, 0])) == [5, 6, 7]
    assert prompt_of(ids, torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.long)) == []


# ---- replay equals the rollout for unchanged weights -----------------------------------------------------


def _record_proposals(tree: Eagle3Drafter) -> list[list[torch.Tensor]]:
    """Keep the draft log-probs of every expansion ``tree`` (an EAGLE-3 tree drafter, alone or composed)
    proposes from: one list per round, the root row's first, then depth order."""
    rounds: list[list[torch.Tensor]] = []
    proposing = [False]
    step, grow = tree.rows.step, tree.grow

    def recording_step(*args, **kwargs):
        h, logp = step(*args, **kwargs)
        if proposing[0]:  # not the committed rows ``accept`` appends
            rounds[-1].append(logp[0].clone())
        return h, logp

    def recording_grow(*args, **kwargs):
        rounds.append([tree.rows.root_draft_logprobs.clone()])
        proposing[0] = True
        try:
            return grow(*args, **kwargs)
        finally:
            proposing[0] = False

    tree.rows.step, tree.grow = recording_step, recording_grow
    return rounds


@pytest.fixture(scope="module")
def eagle3_draft(tiny_target):
    from tests.decoding.conformance.methods import quick_train, spec

    return quick_train(spec("eagle3"), tiny_target)


@pytest.fixture(scope="module")
def confu_draft(tiny_target):
    from tests.decoding.conformance.methods import quick_train, spec

    return quick_train(spec("confu"), tiny_target)


CHAIN = {"branching": 1, "depth": 4, "nodes": 4}  # a chain: each position is one of the drafter's expansions


@pytest.mark.parametrize("method", ["eagle3", "confu"])
def test_replayed_logprobs_equal_the_rollouts(tiny_target, request, method):
    """EAGLE-3 trees (TTT unroll from each round's row) and ConFu (the same, with every round's future
    token rebuilt from the committed sequence): replay equals what the drafter proposed from."""
    draft = request.getfixturevalue(f"{method}_draft")
    if method == "eagle3":
        drafter, replay = Eagle3Drafter(draft, **CHAIN), Eagle3Replay()
        tree = drafter
    else:
        drafter, replay = ConFuDrafter(draft, **CHAIN), ConFuReplay()
        tree = drafter.tree
    proposed_rounds = _record_proposals(tree)
    prompt = list(range(100, 116))
    ros, report = rollout(tiny_target, drafter, [prompt], GenerationConfig(max_new_tokens=24, stop_on_eos=False),
                          vocab_ids=replay.vocab_ids(draft))
    ro = ros[0]
    assert report.success == 1 and ro.rounds == len(proposed_rounds)
    assert any(a.accepted > 0 for a in ro.anchors) and any(a.accepted < a.length for a in ro.anchors)
    K = max(a.length for a in ro.anchors)
    chains = torch.stack([torch.nn.functional.pad(a.chain, (0, K - a.length)) for a in ro.anchors])
    roots = torch.tensor([a.root for a in ro.anchors])
    logq = replay.logprobs(draft, tiny_target, ro.tokens, roots, chains)  # [M, K, V_d]
    assert logq.requires_grad
    for m, (a, proposed) in enumerate(zip(ro.anchors, proposed_rounds)):
        # The chain follows the drafter's own (top-1) proposals, so each position was one of its expansions.
        for k in range(a.length):
            torch.testing.assert_close(logq[m, k].detach(), proposed[k], atol=1e-5, rtol=1e-5)
    # The accepted draft tokens are the committed sequence; the replayed context is that sequence.
    for a in ro.anchors:
        assert ro.tokens[a.root + 1: a.root + 1 + a.accepted].tolist() == a.chain[: a.accepted].tolist()
    if method == "confu":  # the gradient reaches the target-side parts too, through the contemplate rows
        logq.sum().backward()
        assert draft.soft_prompts.grad is not None and draft.soft_prompts.grad.abs().sum() > 0
        draft.zero_grad(set_to_none=True)


class _RecordingBlocks(DFlashDrafter):
    """A DFlash drafter that keeps the draft log-probs of every block it proposes from."""

    def __init__(self, draft, block_size=None):
        super().__init__(draft, block_size=block_size, sampling="argmax")
        self.rounds: list[torch.Tensor] = []

    def _block_pass(self, inputs):
        hidden, logits = super()._block_pass(inputs)  # [bs-1, d], [bs-1, V]
        self.rounds.append(torch.log_softmax(logits.float(), -1).clone())
        return hidden, logits


@pytest.fixture(scope="module")
def dflash_draft(tiny_target):
    from tests.decoding.conformance.methods import quick_train, spec

    return quick_train(spec("dflash"), tiny_target)


@pytest.mark.parametrize("block_size", [None, 5])
def test_dflash_replayed_logprobs_equal_the_rollouts(tiny_target, dflash_draft, block_size):
    """One packed block forward over a rollout's anchors gives each round's block distributions; in a
    shorter block than the trained one too, when the replay is told the drafter's block."""
    replay = DFlashReplay(block_size)
    # A few-step block draft on tiny_random's near-uniform distributions is rarely accepted: take the first
    # corpus prompt on which it is, so that accepted proposals become replayed context.
    for prompt in TRAIN_PROMPTS:
        drafter = _RecordingBlocks(dflash_draft, block_size)
        ros, report = rollout(tiny_target, drafter, [list(prompt)], GenerationConfig(max_new_tokens=24, stop_on_eos=False),
                              vocab_ids=replay.vocab_ids(dflash_draft))
        ro = ros[0]
        assert report.success == 1 and ro.rounds == len(drafter.rounds)
        if any(a.accepted > 0 for a in ro.anchors):
            break
    assert any(a.accepted > 0 for a in ro.anchors) and any(a.accepted < a.length for a in ro.anchors)
    K = max(a.length for a in ro.anchors)
    assert K == drafter.block_size - 1
    chains = torch.stack([torch.nn.functional.pad(a.chain, (0, K - a.length)) for a in ro.anchors])
    roots = torch.tensor([a.root for a in ro.anchors])
    logq = replay.logprobs(dflash_draft, tiny_target, ro.tokens, roots, chains)  # [M, K, V]
    assert logq.requires_grad
    for m, (a, proposed) in enumerate(zip(ro.anchors, drafter.rounds)):
        torch.testing.assert_close(logq[m, : a.length].detach(), proposed[: a.length], atol=1e-5, rtol=1e-5)
    if block_size is not None:  # the trained block is another distribution: the replay must know the block
        other = DFlashReplay(None).logprobs(dflash_draft, tiny_target, ro.tokens, roots, chains)
        assert not torch.allclose(other, logq, atol=1e-4)
    with pytest.raises(ValueError, match="block_size"):
        DFlashReplay(3).logprobs(dflash_draft, tiny_target, ro.tokens, roots, chains)


@pytest.mark.parametrize("base", ["dflash", "confu"])
def test_draft_opd_trains_every_base_and_decodes_losslessly(tiny_target, request, base):
    """``method=draft_opd method@method.base=<m>`` composed from the real conf/: a rollout phase and two
    replay steps move the base's draft (every chain no longer than its drafter proposes), and greedy
    decoding with the result equals AR. (The EAGLE-3 base runs through the conformance suite.)"""
    from draftlab.decoding.engine import autoregressive_generate
    from draftlab.methods.registry import MethodSpec
    from tests.decoding.conformance.methods import sequences
    from tests.methods.corpus import UNSEEN_PROMPT

    spec = MethodSpec.from_name("draft_opd", [f"method@method.base={base}", "method.module.refresh_every=2"])
    assert spec.cfg.base.name == base and spec.axes()["base"] == base
    if base == "confu":  # a chain of 4, as the conformance suite sizes trees
        spec.cfg.base.drafter.update(branching=4, depth=4, nodes=16)
    draft = copy.deepcopy(request.getfixturevalue(f"{base}_draft")).train()
    module = spec.build_module(draft, tiny_target)
    module.log_dict = lambda *a, **k: None  # no trainer attached
    module.generation.max_new_tokens = MethodSpec.from_name("draft_opd", ci=True).cfg.module.generation.max_new_tokens
    seqs = sequences(tiny_target)[:2]
    batch = {"input_ids": torch.tensor([s[:20] for s in seqs]), "attention_mask": torch.ones(2, 20, dtype=torch.long),
             "loss_mask": torch.tensor([[0] * 12 + [1] * 8] * 2)}
    trainable = [p for p in draft.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    opt = torch.optim.Adam(trainable, lr=1e-3)
    for step in range(2):
        loss = module.training_step(batch, step)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert module.buffer_phase == 0 and module.buffer
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trainable))
    draft.eval()
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, stop_on_eos=False)
    ar, _ = autoregressive_generate(tiny_target, UNSEEN_PROMPT, cfg)
    out, _ = speculative_generate(tiny_target, UNSEEN_PROMPT, spec.build_drafter(draft), cfg)
    assert out == ar


# ---- the objective -------------------------------------------------------------------------------------


def _batch(seed=0, M=3, K=4, V=7):
    g = torch.Generator().manual_seed(seed)
    q = torch.log_softmax(torch.randn(M, K, V, generator=g), -1)
    p = torch.log_softmax(torch.randn(M, K, V, generator=g), -1) - 0.3  # not normalised over the draft vocab
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    acc = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    return ReplayBatch(q, p, valid, acc)


def _kl(a, b):  # KL(a || b) from log-probs
    return float((a.exp() * (a - b)).sum())


def test_acceptance_aware_objective_by_hand():
    b = _batch()
    logp = b.target_logprobs - torch.logsumexp(b.target_logprobs, -1, keepdim=True)
    fwd = [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]
    rej = [(0, 1), (0, 2), (2, 0)]
    l_acc = sum(_kl(logp[m, k], b.draft_logprobs[m, k]) for m, k in fwd) / len(fwd)
    w = {k: 0.8 ** k for _, k in rej}
    l_rej = sum(w[k] * _kl(b.draft_logprobs[m, k], logp[m, k]) for m, k in rej) / sum(w[k] for _, k in rej)
    loss, stats = Objective()(b)
    assert float(loss) == pytest.approx((l_acc + l_rej) / 2, rel=1e-5)
    assert int(stats["accepted"]) == 5 and int(stats["rejected"]) == 3
    # Weights are config: lambda_rej = 0 leaves the forward term; gamma = 1 drops the decay.
    assert float(Objective(lambda_rej=0.0)(b)[0]) == pytest.approx(l_acc, rel=1e-5)
    l_rej_flat = sum(_kl(b.draft_logprobs[m, k], logp[m, k]) for m, k in rej) / len(rej)
    assert float(Objective(gamma=1.0, lambda_acc=0.0)(b)[0]) == pytest.approx(l_rej_flat, rel=1e-5)
    # The all-forward ablation: forward KL at every valid position.
    all_fwd = sum(_kl(logp[m, k], b.draft_logprobs[m, k]) for m, k in fwd + rej) / 8
    assert float(Objective(divergence="forward")(b)[0]) == pytest.approx(all_fwd, rel=1e-5)


def test_objective_is_zero_when_the_draft_is_the_target_and_has_gradients():
    b = _batch()
    logp = b.target_logprobs - torch.logsumexp(b.target_logprobs, -1, keepdim=True)
    same = ReplayBatch(logp.clone().requires_grad_(), b.target_logprobs, b.valid, b.accepted)
    loss, _ = Objective()(same)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    q = b.draft_logprobs.clone().requires_grad_()
    Objective()(ReplayBatch(q, b.target_logprobs, b.valid, b.accepted))[0].backward()
    assert q.grad.abs().sum() > 0 and q.grad[0, 3].abs().sum() == 0  # invalid positions get no gradient


def test_sampled_estimators_by_hand():
    b = _batch()
    M, K = b.valid.shape
    committed = torch.full((M, K), -1)
    committed[0, 0], committed[0, 1] = 2, 5  # accepted token, then the first rejected position's correction
    committed[1] = torch.tensor([1, 2, 3, 4])
    committed[2, 0] = 6
    rejected = torch.full((M, K, 2), -1)
    rejected[0, 1] = torch.tensor([3, 4])  # first rejected + sibling
    rejected[0, 2, 0] = 0  # suffix token
    rejected[2, 0, 0] = 1
    sb = ReplayBatch(b.draft_logprobs, b.target_logprobs, b.valid, b.accepted, committed, rejected)
    logp = b.target_logprobs - torch.logsumexp(b.target_logprobs, -1, keepdim=True)

    def bern(m, k, t):
        p, q = math.exp(float(logp[m, k, t])), math.exp(float(b.draft_logprobs[m, k, t]))
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    def k3(m, k, t):
        lr = float(logp[m, k, t] - b.draft_logprobs[m, k, t])
        return math.exp(lr) - 1 - lr

    resp = [(0, 0, 2), (0, 1, 5), (1, 0, 1), (1, 1, 2), (1, 2, 3), (1, 3, 4), (2, 0, 6)]
    rej = [(0, 1, 3), (0, 1, 4), (0, 2, 0), (2, 0, 1)]
    w = [0.8 ** k for _, k, _ in rej]
    expected = (sum(bern(*x) for x in resp) + sum(wi * k3(*x) for wi, x in zip(w, rej))) / (len(resp) + sum(w))
    loss, _ = Objective(estimator="sampled")(sb)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_objective_settings_are_checked():
    with pytest.raises(ValueError, match="estimator"):
        Objective(estimator="mc")
    with pytest.raises(ValueError, match="divergence"):
        Objective(divergence="js")
    with pytest.raises(ValueError, match="lambda"):
        Objective(lambda_acc=0.0, lambda_rej=0.0)


# ---- random_rounds: verification rounds at chosen positions of a rollout ----------------------------------


def _anchors_equal(a, b, atol=1e-5):
    assert (a.root, a.chain.tolist(), a.accepted, sorted(a.rejected), a.committed) == \
        (b.root, b.chain.tolist(), b.accepted, sorted(b.rejected), b.committed)
    torch.testing.assert_close(a.target_logprobs, b.target_logprobs, atol=atol, rtol=atol)


def test_rounds_sit_at_the_chosen_positions_of_a_stub_rollout():
    from draftlab.methods.draft_opd.anchors import round_anchor
    from draftlab.methods.draft_opd.rounds import rounds_at

    target = TableTarget(CYCLE)
    prompt = [0, 5, 6]
    cfg = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    out, _ = speculative_generate(target, prompt, FixedDrafter(_round_tree), cfg)
    tokens = prompt + out
    positions = [10, 3, 6, 5]  # any order: rounds come back sorted by root
    traces = rounds_at(target, FixedDrafter(_round_tree), tokens, len(prompt), positions, cfg)
    assert [t.anchor for t in traces] == sorted(positions)
    for t in traces:
        a = round_anchor(t)
        r = tokens[t.anchor]  # the committed token there is the round's root
        tree = _round_tree(r)
        _, y, _, w = tree.tokens[2:].tolist()
        # The hand-worked round of test_anchor_of_a_hand_worked_tree_round, rooted at the chosen position.
        assert a.root == t.anchor and a.chain.tolist() == [CYCLE[r], y, w] and a.accepted == 1
        assert a.committed == tokens[t.anchor + 2]
        torch.testing.assert_close(a.target_logprobs, torch.log_softmax(target.table[torch.tensor([r, CYCLE[r], y])], -1))
    with pytest.raises(ValueError, match="positions"):
        rounds_at(target, FixedDrafter(_round_tree), tokens, len(prompt), [len(tokens) - 1], cfg)
    with pytest.raises(ValueError, match="distinct"):
        rounds_at(target, FixedDrafter(_round_tree), tokens, len(prompt), [4, 4], cfg)


SMALL_TREE = {"branching": 3, "depth": 3, "nodes": 6}  # the rollouts' fixed tree in experiments/draft_opd


def _drafter(method, draft):
    return Eagle3Drafter(draft, **SMALL_TREE) if method == "eagle3" else DFlashDrafter(draft, sampling="argmax")


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_rounds_at_the_rollout_roots_are_the_error_anchors(tiny_target, request, method):
    """Rounds placed where the rollout's own rounds were give back its anchors: the forced walk keeps the
    target cache and the drafter's state as the engine does."""
    from draftlab.methods.draft_opd.anchors import trace_anchors as anchors_of
    from draftlab.methods.draft_opd.rounds import rounds_at

    draft = request.getfixturevalue(f"{method}_draft")
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    prompt = list(range(100, 116))
    out, stats = speculative_generate(tiny_target, prompt, _drafter(method, draft), cfg, trace=True)
    error = anchors_of(stats.trace)
    traces = rounds_at(tiny_target, _drafter(method, draft), prompt + out, len(prompt), [a.root for a in error], cfg)
    again = anchors_of(traces)
    assert len(again) == len(error)
    for a, b in zip(again, error):
        _anchors_equal(a, b)


def test_rounds_at_random_positions_are_real_rounds(tiny_target, eagle3_draft):
    """At positions no rollout round started from, each round equals the first round of a fresh decode of
    that prefix (the same drafter, tree and target), and its target log-probs equal a fresh target forward
    over prefix + chain."""
    from draftlab.methods.draft_opd.anchors import round_anchor
    from draftlab.methods.draft_opd.rounds import rounds_at

    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    prompt = list(range(100, 116))
    out, stats = speculative_generate(tiny_target, prompt, _drafter("eagle3", eagle3_draft), cfg, trace=True)
    tokens, P = prompt + out, len(prompt)
    roots = {t.anchor for t in stats.trace}
    positions = [p for p in range(P + 1, len(tokens) - 1) if p not in roots][:5] + [P + 3, len(tokens) - 2]
    positions = sorted(set(positions))
    assert any(p not in roots for p in positions)
    anchors = [round_anchor(t) for t in rounds_at(tiny_target, _drafter("eagle3", eagle3_draft), tokens, P,
                                                  positions, cfg)]
    assert [a.root for a in anchors] == positions
    assert any(a.accepted < a.length for a in anchors)  # rejected positions too: the reverse-KL term stays
    for a in anchors:
        # The accepted chain is the committed continuation (T=0), and the committed token follows it.
        assert a.chain[: a.accepted].tolist() == tokens[a.root + 1: a.root + 1 + a.accepted]
        if a.root + 1 + a.accepted < len(tokens):
            assert a.committed == tokens[a.root + 1 + a.accepted]
        seq = torch.tensor([tokens[: a.root + 1] + a.chain[:-1].tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_target.forward(seq).logits[0].float(), -1)[a.root:]  # [K, V]
        torch.testing.assert_close(a.target_logprobs, logp, atol=1e-4, rtol=1e-4)
        # A fresh decode of the prefix: its root is the committed token (T=0), its first round this one.
        _, fresh = speculative_generate(tiny_target, tokens[: a.root], _drafter("eagle3", eagle3_draft),
                                        GenerationConfig(max_new_tokens=2, stop_on_eos=False), trace=True)
        _anchors_equal(a, round_anchor(fresh.trace[0]), atol=1e-4)


def test_random_rounds_module_places_as_many_anchors_reproducibly(tiny_target, eagle3_draft):
    """``anchors=random_rounds`` through the module: per rollout as many anchors as the error rule, at
    distinct response positions, with accepted and rejected positions; a phase recomputed (a resume before
    its first checkpoint) places the same anchors; replay keeps the rejected positions' reverse-KL term."""
    from draftlab.methods.registry import MethodSpec
    from tests.decoding.conformance.methods import sequences

    spec = MethodSpec.from_name("draft_opd", ["method.module.anchors=random_rounds", "method.module.refresh_every=2"])
    assert spec.axes()["anchors"] == "random_rounds"
    spec.cfg.base.drafter.update(**SMALL_TREE)
    module = spec.build_module(copy.deepcopy(eagle3_draft).train(), tiny_target)
    module.log_dict = lambda *a, **k: None  # no trainer attached
    module.generation.max_new_tokens = 24
    seqs = sequences(tiny_target)[:2]
    batch = {"input_ids": torch.tensor([s[:20] for s in seqs]), "attention_mask": torch.ones(2, 20, dtype=torch.long),
             "loss_mask": torch.tensor([[0] * 12 + [1] * 8] * 2)}
    error, _ = module.decode(module._prompts(batch))
    module.start_phase(0, batch)
    assert len(module.buffer) == len(error)
    for ro, err in zip(module.buffer, error):
        assert torch.equal(ro.tokens, err.tokens) and ro.rounds == err.rounds
        roots = [a.root for a in ro.anchors]
        assert len(set(roots)) == len(roots) and all(ro.prompt_len <= r <= len(ro.tokens) - 2 for r in roots)
    # The positions are the phase's seeded draw (here, from a draft rejected almost everywhere, nearly every
    # response position: as many rounds as positions leaves little room to place them elsewhere).
    gen = torch.Generator().manual_seed(module.seed * 1_000_003 + 0)
    for ro in module.buffer:
        room = len(ro.tokens) - 1 - ro.prompt_len
        drawn = (ro.prompt_len + torch.randperm(room, generator=gen)[: ro.rounds]).tolist()
        assert [a.root for a in ro.anchors] == sorted(drawn)
    first = [list(ro.anchors) for ro in module.buffer]
    module.start_phase(0, batch)
    for ro, anchors in zip(module.buffer, first):
        for a, b in zip(ro.anchors, anchors):
            _anchors_equal(a, b, atol=0.0)
    module.steps_done = 0
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss)
    _, stats = module.objective(module.replay_batch(module._chosen(0, 0)))
    assert int(stats["rejected"]) > 0 and float(stats["rev_term"]) > 0  # unlike ``random``: rejected positions
