"""``PassRequest``: what a target pass computes besides logits, and the engine's ``VerifyPass`` built from it.

References are independent of the explicit forward where possible: HF's own forward
(``output_hidden_states``) for taps, final hidden states and logits; for pinned rows, the same rows run
inside the pass.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from draftlab.decoding.engine import pass_request, verify_pass
from draftlab.decoding.tree import DraftTree
from draftlab.methods.confu.contemplate import soft_prompt_kv, verify_extra_rows
from draftlab.targets.base import LayerConvention, PassRequest, to_hf_hidden_index

ATOL = 1e-5


def _hf(target, ids):
    with torch.no_grad():
        return target.model(ids, output_hidden_states=True)


def test_request_taps_hidden_and_logit_rows_match_hf(tiny_target):
    t = tiny_target
    assert t.layer_convention is LayerConvention.OUTPUT_OF
    ids = torch.randint(t.geometry.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = _hf(t, ids)
    rows = torch.tensor([2, 8])
    # Layer 0 only: HF's last hidden state (layer 1's output) is taken after the final norm.
    out = t.forward(ids, request=PassRequest(aux=[0, 0], last_hidden=True, logits_rows=rows))
    tap = ref.hidden_states[to_hf_hidden_index(0, t.layer_convention)]  # [2, 9, d]
    torch.testing.assert_close(out.aux_hidden, torch.cat([tap, tap], -1), rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[-1], rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(out.logits, ref.logits[:, rows], rtol=0, atol=ATOL)
    assert out.attn_mass is None


def test_request_defaults(tiny_target):
    t = tiny_target
    ids = torch.randint(t.geometry.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = t.forward(ids)
    assert plain.aux_hidden is None and plain.last_hidden is None and plain.attn_mass is None
    torch.testing.assert_close(plain.logits, t.forward(ids, request=PassRequest()).logits, rtol=0, atol=0)
    # aux=True: the target's default taps; an empty list: none.
    default = t.forward(ids, request=PassRequest(aux=True)).aux_hidden
    named = t.forward(ids, request=PassRequest(aux=t.aux_layer_ids)).aux_hidden
    torch.testing.assert_close(default, named, rtol=0, atol=0)
    assert default.shape[-1] == len(t.aux_layer_ids) * t.geometry.hidden_size
    assert t.forward(ids, request=PassRequest(aux=[])).aux_hidden is None
    assert t.forward(ids, request=PassRequest(logits_rows=torch.arange(0))).logits.shape == (1, 0,
                                                                                            t.geometry.vocab_size)
    with pytest.raises(ValueError, match="out of range"):
        t.forward(ids, request=PassRequest(aux=[t.geometry.num_layers]))


class _Tapping:
    """A drafter stand-in that asks for taps and attention mass (what ``pass_request`` reads)."""

    def __init__(self, taps, rows):
        self._taps, self.rows = taps, rows

    def taps(self, target):
        return self._taps

    def attention_rows(self):
        return self.rows


def _committed(target, prefix, scratch):
    cache = target.new_cache(1, len(prefix) + scratch)
    target.forward(torch.tensor([prefix]), cache=cache)
    cache.commit(len(prefix))
    return cache


def test_verify_pass_with_pinned_rows_matches_rows_in_the_pass_and_hf(tiny_target):
    """One verify pass, built once: tree rows + contemplate rows that read soft prompts, pinned (keys computed
    once) or as rows of the pass. Tree rows: HF's logits along each root-to-node path, and the aux states
    of the taps; contemplate rows: the same logits / final hidden / aux states either way."""
    t = tiny_target
    g = torch.Generator().manual_seed(7)
    V, d = t.geometry.vocab_size, t.geometry.hidden_size
    prefix = torch.randint(V, (10,), generator=g).tolist()
    tree = DraftTree.from_parents(torch.randint(V, (6,), generator=g), torch.tensor([-1, 0, 0, 1, 1, 3]))
    soft = torch.randn(3, d, generator=g) * 0.5  # [s, d]
    con = torch.randn(d, generator=g) * 0.5  # [d]
    past = len(prefix) - 1  # the last prefix token is the tree's root, not yet committed
    base = pass_request(t, _Tapping([0, 1], 2))
    assert base == PassRequest(aux=[0, 1], attn_mass_rows=2)
    tree = DraftTree.from_parents(torch.cat([torch.tensor([prefix[-1]]), tree.tokens[1:]]), tree.parents)

    outs = {}
    for pinned in (True, False):
        rows = verify_extra_rows(soft_prompt_kv(t, soft) if pinned else soft, con, tree.parents, tree.depth, past)
        rows = replace(rows, want_logits=True, want_hidden=True)
        cache = _committed(t, prefix[:-1], 64)
        vpass = verify_pass(t, tree, rows, past, base, scratch=64)
        assert vpass.ids is None and vpass.request.input_embeds.shape == (1, vpass.positions.shape[0], d)
        assert (vpass.request.pinned is not None) == pinned
        vout = vpass.run(t, cache)
        assert vout.attn_mass.shape[-1] == past + vpass.positions.shape[0]  # pinned columns left out
        outs[pinned] = (vout, vpass.extra_output(vout))

    n = tree.size
    for vout, _ in outs.values():
        parents = tree.parents.tolist()
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.append(int(tree.tokens[j]))
                j = parents[j]
            seq = torch.tensor([prefix[:-1] + path[::-1]])
            ref = _hf(t, seq)
            torch.testing.assert_close(vout.logits[0, i], ref.logits[0, -1], rtol=0, atol=ATOL)
            torch.testing.assert_close(vout.aux_hidden[0, i, :d], ref.hidden_states[1][0, -1], rtol=1e-5, atol=ATOL)
    (_, pinned_rows), (_, full_rows) = outs[True], outs[False]
    s = soft.shape[0]
    for field in ("logits", "hidden", "aux"):  # hidden states are ~10: a relative bound as well
        torch.testing.assert_close(getattr(pinned_rows, field), getattr(full_rows, field)[s:], rtol=1e-5, atol=ATOL)


def test_verify_pass_refuses_more_rows_than_reserved(tiny_target):
    tree = DraftTree.chain(1, [2, 3, 4])
    with pytest.raises(RuntimeError, match=r"4 rows .* exceeds the 3 scratch rows"):
        verify_pass(tiny_target, tree, None, 5, PassRequest(), scratch=3)
