"""The ConFu drafter in the shared engine: contemplate rows are invisible, greedy decoding equals AR, and
inference computes exactly what training computes."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import draftlab.targets.hf as hf_target
from draftlab.data.vocab import build_vocab_mapping
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.confu import ConFuDraft, ConFuDrafter, ConFuModule
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT, greedy, train_sequences


def _cfg(drafter, n):
    # No scratch_rows: the engine reserves drafter.scratch_rows (> the default 128 for 60 nodes + 16 soft prompts).
    return GenerationConfig(max_new_tokens=n, stop_on_eos=False)


def _batch(seqs, prompt_lens):
    B, T = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    attn = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
    loss_mask = torch.zeros(B, T)  # [B, T]
    for i, (seq, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, :len(seq)], attn[i, :len(seq)] = torch.tensor(seq), True
        loss_mask[i, p - 1:len(seq)] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


@pytest.fixture(scope="module")
def trained(tiny_target):
    # A 2-layer ConFu draft (window 2) trained on the target's own greedy continuations of TRAIN_PROMPTS.
    # Two layers make the committed rows' keys depend on which future they saw, so a visibility mismatch
    # between drafter and trainer shows up in later logits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seqs = train_sequences(tiny_target)
        batch = _batch(seqs, [len(p) for p in TRAIN_PROMPTS])
        V = tiny_target.geometry.vocab_size
        mapping = build_vocab_mapping(torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V), 256)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            draft = ConFuDraft.from_target(tiny_target, vocab_mapping=mapping, num_layers=2, intermediate_size=96,
                                           num_soft_prompts=4, replicate_length=2)
            module = ConFuModule(draft, tiny_target, num_anchors=16, ttt_length=4)
            opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=2e-2)
            for _ in range(20):
                loss = module.confu_forward(batch).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
        draft.eval()
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(draft=draft, module=module, refs={tuple(p): s[len(p):] for p, s in zip(TRAIN_PROMPTS, seqs)})


class _CheckingTarget:
    # Wraps the target: every verify pass with extra rows is first re-run WITHOUT them, and the normal rows'
    # logits, aux states and cache keys/values of both runs are compared.

    def __init__(self, target, num_soft: int):
        self.target, self.num_soft = target, num_soft
        self.checked, self.max_err, self.max_rel = 0, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, input_ids, position_ids=None, cache=None, attn_mask=None, request=None):
        input_embeds = request.input_embeds if request is not None else None
        if input_embeds is None or attn_mask is None:
            return self.target.forward(input_ids, position_ids, cache, attn_mask, request)
        n = (input_embeds.shape[1] - self.num_soft) // 2
        past = cache.length
        # The tree rows alone, as a pass without contemplate rows would run them (tree rows see no pinned rows).
        plain_request = replace(request, input_embeds=input_embeds[:, :n], pinned=None, pinned_mask=None)
        plain = self.target.forward(None, position_ids[:n], cache, attn_mask[:n, :past + n], plain_request)
        k_plain = cache.k[:, :, :, past:past + n].clone()
        out = self.target.forward(None, position_ids, cache, attn_mask, request)
        errs = [(out.logits[0, :n] - plain.logits[0]).abs().max(),
                (out.aux_hidden[0, :n] - plain.aux_hidden[0]).abs().max(),
                (cache.k[:, :, :, past:past + n] - k_plain).abs().max()]
        self.max_err = max(self.max_err, *(float(e) for e in errs))
        self.max_rel = max(self.max_rel, float(errs[0] / plain.logits.abs().max()))
        self.checked += 1
        return out


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("kernel", ["grouped", "default"])
@pytest.mark.parametrize("branching, depth, nodes, soft", [(4, 4, 16, 4), (10, 5, 60, 16)])
def test_contemplate_rows_leave_normal_rows_untouched(tiny_target, trained, branching, depth, nodes, soft, kernel,
                                                      cached, monkeypatch):
    """Normal rows' logits, aux states and cached keys are those of the same pass without contemplate rows.

    Under one attention kernel they agree to <= 1e-5 (in fact bit for bit). With the target's default
    kernel choice a pass past 128 rows switches to fused SDPA while the plain pass does not; that
    kernel's reduction order depends on the key count, so there the bound is relative to the logits.
    """
    draft = trained.draft
    if soft != draft.config.num_soft_prompts:
        # More soft prompts push the pass past 128 rows, where the target switches to fused SDPA.
        draft = copy.deepcopy(draft)
        draft.config.num_soft_prompts = soft
        draft.soft_prompts = torch.nn.Parameter(draft.soft_prompts.repeat(soft // draft.soft_prompts.shape[0], 1))
    if kernel == "grouped":
        monkeypatch.setattr(hf_target, "_GROUPED_ATTENTION_MAX_ROWS", 10**6)
    checking = _CheckingTarget(tiny_target, 0 if cached else soft)
    drafter = ConFuDrafter(draft, branching=branching, depth=depth, nodes=nodes, cache_soft_prompts=cached)
    prompt = TRAIN_PROMPTS[0]
    out, stats = speculative_generate(checking, prompt, drafter, _cfg(drafter, 24))
    assert checking.checked >= 3
    assert out == trained.refs[tuple(prompt)][:24]
    if kernel == "grouped" or 2 * max(stats.tree_sizes) + (0 if cached else soft) <= 128:
        assert checking.max_err <= 1e-5, checking.max_err
    else:
        assert checking.max_rel <= 1e-5, checking.max_rel


# Greedy output == AR for every ConFu config: tests/decoding/conformance.


class _Recording(ConFuDrafter):
    # Records the draft's log-probs at every anchor row and at every tree row it grows (by wrapping the
    # composed drafter's ``DraftRows.run``: tree rows are the ones that run while ``propose`` is on).

    def reset(self, state):
        rows = self.tree.rows
        if "run" not in vars(rows):
            run = rows.run

            def recording(ids, hidden, positions, mask=None, side=None):
                past = rows.cache.length
                h, logp = run(ids, hidden, positions, mask, side)
                if self._growing:  # provisional slots lie past the committed rows
                    committed, tokens, out = self.rounds[-1]
                    for j, tok in enumerate(ids.tolist()):
                        tokens[past + j] = tok
                    for j in range(ids.shape[0]):
                        out.append(([tokens[int(c)] for c in mask[j].nonzero().flatten() if c > committed], logp[j]))
                return h, logp

            rows.run = recording
        self._growing = False
        super().reset(state)
        self.roots = [(self.num_committed - 1, self.root_logprobs.clone())]
        self.rounds = []  # per round: (anchor row, {slot: token}, [(token path from the root, log-probs)])

    def update(self, state, out):
        super().update(state, out)
        self.roots.append((self.num_committed - 1, self.root_logprobs.clone()))

    def propose(self, state):
        self.rounds.append((self.num_committed - 1, {}, []))
        self._growing = True
        try:
            return super().propose(state)
        finally:
            self._growing = False


def _training_log_probs(module, seq, anchors, lags) -> list[torch.Tensor]:
    # Draft log-probs ``[T, V_d]`` of every TTT step of the training forward over ``seq``.
    steps: list[torch.Tensor] = []
    hook = module.draft.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach()[0]))
    try:
        with torch.no_grad():
            module.confu_forward({"input_ids": torch.tensor([seq]), "loss_mask": torch.ones(1, len(seq))},
                                 anchors, lags)
    finally:
        hook.remove()
    return [torch.log_softmax(s, -1) for s in steps]


@pytest.mark.parametrize("replicate", [True, False])
def test_inference_computes_what_training_computes(tiny_target, trained, replicate):
    """Anchor rows (depth-1 proposals) and tree rows along the true continuation (depth k >= 2) give the
    log-probs of the training pass (``ConFuModule.confu_forward``, TTT step k at the anchor row) when the
    trainer is handed the drafter's anchors and [con] lags."""
    draft = trained.draft
    if not replicate:
        draft = copy.deepcopy(draft)
        draft.config.replicate = False
    module = ConFuModule(draft, tiny_target, ttt_length=4)
    ids_d = draft.target_ids()
    compared = {"root": 0, "tree": 0}
    for prompt in TRAIN_PROMPTS[:2] + [UNSEEN_PROMPT]:
        drafter = _Recording(draft, branching=4, depth=4, nodes=16)
        out, _ = speculative_generate(tiny_target, prompt, drafter, _cfg(drafter, 30))
        seq = prompt + out
        assert out == greedy(tiny_target, prompt, 30)
        assert drafter.num_committed == len(prompt) + 30 - 1  # one draft row per token, never a future row
        anchors = torch.tensor([[a for a, _ in drafter.anchors]])
        lags = torch.tensor([[lag for _, lag in drafter.anchors]])
        logq = _training_log_probs(module, seq, anchors, lags)
        assert [a for a, _ in drafter.roots] == anchors[0].tolist()
        for a, root in drafter.roots:
            assert torch.allclose(logq[0][a], root[ids_d], atol=1e-4)
            compared["root"] += 1
        for a, _, rows in drafter.rounds:
            for path, logp in rows:
                k = len(path)
                if k < len(logq) and seq[a + 2:a + 2 + k] == path:
                    assert torch.allclose(logq[k][a], logp[ids_d], atol=1e-4), (a, k)
                    compared["tree"] += 1
    assert compared["root"] >= 20 and compared["tree"] >= 20, compared


def test_the_contemplate_path_feeds_the_draft(tiny_target, trained):
    """Other soft prompts change the future token and hence the draft's proposals, never the output."""
    other = copy.deepcopy(trained.draft)
    with torch.no_grad():
        other.soft_prompts.add_(torch.randn_like(other.soft_prompts))
    prompt = UNSEEN_PROMPT
    a, b = _Recording(trained.draft, branching=4, depth=4, nodes=16), _Recording(other, branching=4, depth=4,
                                                                                     nodes=16)
    out_a, _ = speculative_generate(tiny_target, prompt, a, _cfg(a, 20))
    out_b, _ = speculative_generate(tiny_target, prompt, b, _cfg(b, 20))
    assert out_a == out_b == greedy(tiny_target, prompt, 20)
    assert not torch.allclose(a.roots[0][1], b.roots[0][1], atol=1e-3)


class _RowCounter:
    # Records the number of rows of every verify pass that carries extra rows.

    def __init__(self, target):
        self.target, self.rows = target, []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, *args, **kw):
        request = args[4] if len(args) > 4 else kw.get("request")
        input_embeds = request.input_embeds if request is not None else None
        if input_embeds is not None and len(args) > 3 and args[3] is not None:  # a verify pass (tree mask)
            self.rows.append(input_embeds.shape[1])
        return self.target.forward(*args, **kw)


def test_pinned_soft_prompts_compute_what_soft_prompt_rows_compute(tiny_target, trained):
    """Soft prompts pinned (keys once per draft) or run as rows of every verify pass: the same drafts, the
    same futures (draft log-probs at every anchor), and s fewer rows per verify pass."""
    prompt = TRAIN_PROMPTS[1]
    runs = {}
    for cached in (True, False):
        counter = _RowCounter(tiny_target)
        drafter = _Recording(trained.draft, branching=4, depth=4, nodes=16, cache_soft_prompts=cached)
        # One drafter for two sequences: the second starts from a clean draft cache.
        first, _ = speculative_generate(counter, TRAIN_PROMPTS[0], drafter, _cfg(drafter, 12))
        assert first == trained.refs[tuple(TRAIN_PROMPTS[0])][:12]
        counter.rows.clear()
        out, stats = speculative_generate(counter, prompt, drafter, _cfg(drafter, 24))
        runs[cached] = (out, stats, drafter, counter.rows)
    (out_c, st_c, d_c, rows_c), (out_r, st_r, d_r, rows_r) = runs[True], runs[False]
    assert out_c == out_r == trained.refs[tuple(prompt)][:24]
    assert st_c.accept_lengths == st_r.accept_lengths and d_c.anchors == d_r.anchors
    for (a, lp_c), (b, lp_r) in zip(d_c.roots, d_r.roots, strict=True):
        assert a == b
        torch.testing.assert_close(lp_c, lp_r, rtol=0, atol=1e-5)
    s = trained.draft.config.num_soft_prompts
    assert rows_c and [r + s for r in rows_c] == rows_r
    assert d_c.scratch_rows(None) + s == d_r.scratch_rows(None)
