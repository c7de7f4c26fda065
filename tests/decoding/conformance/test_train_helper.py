"""The suite's training helper (``methods._train``) trains what the plain loop trains: its frozen-target memo
(each batch's target side computed once) changes no weight."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from draftlab.methods.eagle3 import ttt
from tests.decoding.conformance import methods
from tests.decoding.conformance.methods import spec


def test_the_frozen_target_memo_trains_the_same_draft(tiny_target, monkeypatch):
    s = spec("eagle3")
    memo = methods._train(s, tiny_target, steps=8, lr=methods.TRAIN_LR)  # 8 steps: each batch comes round again
    of = ttt._TargetSide.__dict__["of"]
    monkeypatch.setattr(methods, "_frozen_target_memo", lambda module: nullcontext())
    plain = methods._train(s, tiny_target, steps=8, lr=methods.TRAIN_LR)
    assert ttt._TargetSide.__dict__["of"] is of  # the memo put the method back
    a, b = memo.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the memo changed the trained draft"
