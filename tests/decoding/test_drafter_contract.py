"""The engine side of the ``Drafter`` contract: defaults, declared taps and rows, typed verify outputs."""

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import draftlab.decoding as decoding
from draftlab.decoding.drafter import Drafter, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.targets.base import PassRequest
from tests.stubs import TableTarget

CYCLE = {i: i % 9 + 1 for i in range(0, 10)}


def _code_only(path: Path) -> str:
    # The module's code with comments and strings (docstrings included) removed.
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return " ".join(t.string for t in toks if t.type not in (tokenize.COMMENT, tokenize.STRING))


def test_the_engine_names_no_method_and_probes_no_drafter():
    banned = re.compile(r"confu|eagle|dflash|hasattr|getattr|isinstance\(.*Draft", re.IGNORECASE)
    for path in Path(decoding.__file__).parent.glob("*.py"):
        hits = banned.findall(_code_only(path))
        assert not hits, (path.name, hits)


def test_protocol_defaults():
    class Minimal(Drafter):
        def propose(self, state):
            return DraftTree.chain(state.root, [])

    d = Minimal()
    assert isinstance(d, Drafter) and isinstance(NoDrafter(), Drafter)
    assert d.taps(None) is None and d.scratch_rows(GenerationConfig()) is None
    assert d.extra_rows(None, None) is None and d.reset(None) is None and d.update(None, None) is None
    assert d.verify_forward(None, None) is None and d.sequence_stats() is None and d.attention_rows() is None
    out, stats = speculative_generate(TableTarget(CYCLE), [0], d, GenerationConfig(max_new_tokens=5,
                                                                                   stop_on_eos=False))
    assert out == [1, 2, 3, 4, 5] and stats.tau == 1.0 and stats.drafter_stats is None


def test_sequence_stats_reach_the_decode_stats_and_the_answer_record():
    from draftlab.eval.answers import answer_record, validate_answer
    from draftlab.eval.turns import TurnAnswer

    class Counting(_Chain):
        def reset(self, state):
            self.rounds = 0

        def propose(self, state):
            self.rounds += 1
            return super().propose(state)

        def sequence_stats(self):
            return {"rounds_seen": self.rounds}

    cfg = GenerationConfig(max_new_tokens=7, stop_on_eos=False)
    out, stats = speculative_generate(TableTarget(CYCLE), [0], Counting(3), cfg)
    assert stats.drafter_stats == {"rounds_seen": stats.rounds} and stats.as_dict()["drafter_stats"] == stats.drafter_stats

    class Q:
        question_id, category = 1, "qa"

    record = answer_record(Q, [TurnAnswer([0], out, "x", stats)], "m")
    assert validate_answer(record)["choices"][0]["drafter_stats"] == [{"rounds_seen": stats.rounds}]
    record["choices"][0]["drafter_stats"] = [{"rounds_seen": "many"}]
    with pytest.raises(ValueError, match=r"choices\[0\]\.drafter_stats\[0\]"):
        validate_answer(record)
    record["choices"][0]["drafter_stats"] = []
    with pytest.raises(ValueError, match="one entry per turn"):
        validate_answer(record)
    _, ar_stats = autoregressive_generate(TableTarget(CYCLE), [0], cfg)
    assert "drafter_stats" not in answer_record(Q, [TurnAnswer([0], out, "x", ar_stats)], "ar")["choices"][0]


class _Chain(Drafter):
    """A chain of the stub's greedy continuation, recording every VerifyOutput."""

    def __init__(self, k, rows=None):
        self.k, self.rows, self.outs = k, rows, []

    def scratch_rows(self, cfg):
        return self.rows

    def propose(self, state):
        toks, cur = [], state.root
        for _ in range(self.k):
            cur = CYCLE[cur]
            toks.append(cur)
        return DraftTree.chain(state.root, toks)

    def update(self, state, out):
        self.outs.append(out)


def test_update_gets_a_typed_verify_output_and_kept_counts():
    target = TableTarget(CYCLE)
    drafter = _Chain(3)
    out, stats = speculative_generate(target, [0], drafter, GenerationConfig(max_new_tokens=7, stop_on_eos=False))
    assert out == [1, 2, 3, 4, 5, 6, 7] and stats.accept_lengths == [4, 2]
    first, last = drafter.outs
    assert isinstance(first, VerifyOutput) and first.kept == 4 and first.kept_path == [0, 1, 2, 3]
    torch.testing.assert_close(first.logits, target.table[first.tree.tokens])
    assert first.aux is None and first.accepted_aux is None and first.extra is None  # no taps asked for
    assert last.kept == 2 and last.kept_path == [0, 1] and last.result.path == [0, 1, 2, 3]


def test_verify_rows_is_reserved_and_enforced():
    target = TableTarget(CYCLE)
    cfg = GenerationConfig(max_new_tokens=20, stop_on_eos=False, scratch_rows=4)
    # Declared: the engine reserves 9 scratch rows although the config says 4.
    out, stats = speculative_generate(target, [0], _Chain(8, rows=9), cfg)
    assert out == autoregressive_generate(target, [0], cfg)[0] and max(stats.tree_sizes) == 9
    # Undeclared: a clear error instead of a cache overflow somewhere later.
    with pytest.raises(RuntimeError, match="scratch_rows"):
        speculative_generate(target, [0], _Chain(8), cfg)


class _Mirror(Drafter):
    """Taps ``taps`` and adds one extra row per tree node that reproduces that node's own row: same
    embedding and position, attending to the prefix and the node's strict ancestors among the tree rows
    and to itself. The extra rows' outputs must then equal the tree rows' outputs."""

    def __init__(self, taps):
        self._taps, self.outs = taps, []

    def taps(self, target):
        return self._taps

    def propose(self, state):
        g = torch.Generator().manual_seed(len(state.tokens))
        return DraftTree.from_parents(torch.randint(0, 5000, (6,), generator=g).index_fill_(0, torch.tensor([0]),
                                                                                              state.root),
                                      [-1, 0, 0, 1, 1, 3])

    def extra_rows(self, state, tree):
        n = tree.size
        mask = torch.cat([ancestor_mask(tree.parents) & ~torch.eye(n, dtype=torch.bool),
                          torch.eye(n, dtype=torch.bool)], 1)  # [N, N + N]
        embeds = state.target.model.get_input_embeddings()(tree.tokens)  # [N, d]
        return ExtraRows(embeds=embeds, tree_mask=mask, position_ids=state.cache.length + tree.depth,
                         want_logits=True, want_hidden=True)

    def update(self, state, out):
        self.outs.append(out)


@torch.no_grad()
def test_extra_rows_and_taps_through_the_verify_pass(tiny_target):
    taps = [1, 0]  # not the target's default taps, in a non-sorted order
    drafter = _Mirror(taps)
    prompt = list(range(100, 112))
    out, stats = speculative_generate(tiny_target, prompt, drafter, GenerationConfig(max_new_tokens=4,
                                                                                     stop_on_eos=False))
    assert out == autoregressive_generate(tiny_target, prompt, GenerationConfig(max_new_tokens=4,
                                                                                stop_on_eos=False))[0]
    d = tiny_target.geometry.hidden_size
    for o in drafter.outs:
        n = o.tree.size
        assert o.extra.logits.shape == o.logits.shape and o.extra.aux.shape == (n, 2 * d)
        torch.testing.assert_close(o.extra.logits, o.logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(o.extra.aux, o.aux, rtol=0, atol=1e-4)
        head = tiny_target.model.lm_head
        torch.testing.assert_close(head(o.extra.hidden), o.extra.logits, rtol=0, atol=1e-4)
        assert o.accepted_aux.shape == (o.kept, 2 * d)
        torch.testing.assert_close(o.accepted_aux, o.aux[o.kept_path])
    # The taps are the drafter's, in its order: the root row of round 1 against a plain forward.
    seq = prompt + out[:1]
    ref = tiny_target.forward(torch.tensor([seq]), request=PassRequest(aux=taps)).aux_hidden[0, -1]
    torch.testing.assert_close(drafter.outs[0].aux[0], ref, rtol=0, atol=1e-4)


def test_extra_rows_skip_the_lm_head_unless_asked(tiny_target):
    class NoLogits(_Mirror):
        def extra_rows(self, state, tree):
            rows = super().extra_rows(state, tree)
            rows.want_logits = rows.want_hidden = False
            return rows

    drafter = NoLogits(None)
    speculative_generate(tiny_target, [1, 2, 3, 4], drafter, GenerationConfig(max_new_tokens=3, stop_on_eos=False))
    o = drafter.outs[0]
    assert o.extra.logits is None and o.extra.hidden is None and o.extra.aux is None
    assert o.logits.shape[0] == o.tree.size


def test_attention_rows_reach_the_drafter(tiny_target):
    """A drafter asking for ``attention_rows`` gets the prefill's and every verify pass's attention mass,
    exactly what ``Target.forward`` with ``PassRequest(attn_mass_rows=W)`` reports for those passes; others get none."""

    class Chain2(Drafter):
        def __init__(self, rows):
            self.rows, self.seen = rows, []

        def attention_rows(self):
            return self.rows

        def reset(self, state):
            self.seen.append(("prefill", len(state.tokens) - 1, state.attn_mass))

        def propose(self, state):
            return DraftTree.chain(state.root, [5, 6])

        def update(self, state, out):
            assert out.attn_mass is state.attn_mass
            self.seen.append(("verify", out.tree.size, out.attn_mass))

    prompt = list(range(100, 120))
    d = Chain2(3)
    speculative_generate(tiny_target, prompt, d, GenerationConfig(max_new_tokens=4, stop_on_eos=False))
    g = tiny_target.geometry
    kind, past, mass = d.seen[0]
    assert kind == "prefill" and mass.shape == (g.num_layers, g.num_kv_heads, len(prompt))
    ref = tiny_target.forward(torch.tensor([prompt]), request=PassRequest(attn_mass_rows=3)).attn_mass[:, 0]
    torch.testing.assert_close(mass, ref, rtol=0, atol=1e-5)
    verify_passes = d.seen[1:]
    assert verify_passes and all(m.shape[-1] >= len(prompt) + n for _, n, m in verify_passes)
    # Three rows of mass, per query head of each KV head: the last 3 rows of the 3-row chain pass.
    G = g.num_heads // g.num_kv_heads
    for _, _, m in verify_passes:
        torch.testing.assert_close(m.sum(-1), torch.full_like(m.sum(-1), 3.0 * G), rtol=0, atol=1e-4)

    plain = Chain2(None)
    speculative_generate(tiny_target, prompt, plain, GenerationConfig(max_new_tokens=4, stop_on_eos=False))
    assert all(m is None for _, _, m in plain.seen)
