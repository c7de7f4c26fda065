"""Every shipped method config, built through the registry, plus a quick generic training run.

A freshly built draft proposes noise; checks that pass with nothing accepted prove little. So trainable
methods are trained for a few steps through their own registry seams (``build_module`` +
``build_datamodule``, the calls the pipeline makes) on the target's greedy continuations of the shared
corpus, which makes their trees accepted often enough that every commit path runs.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import cache

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.data.template import RenderedSample
from draftlab.data.vocab import build_vocab_mapping
from draftlab.methods.registry import MethodSpec, method_names
from tests.draft_store import shared_draft, shared_json, target_identity
from tests.methods.corpus import TRAIN_PROMPTS, train_sequences

METHODS = method_names()


def per_method(names) -> list:
    """Parameters over method names that keep each method's tests on one parallel worker (``--dist
    loadgroup``): a trainable method's quickly trained draft is cached per process, so splitting a method's
    tests across workers would train it once per worker."""
    return [pytest.param(n, marks=pytest.mark.xdist_group(f"method-{n}")) for n in names]


TRAIN_STEPS = 20
TRAIN_LR = 2e-2
CONTINUE_LR = 1e-3


@cache
def spec(name: str) -> MethodSpec:
    """The method config with its CPU-test knobs (its ``ci`` block, and its base's): the suite names no
    method's settings."""
    return MethodSpec.from_name(name, ci=True)


_SEQS: dict[int, list[list[int]]] = {}


def untrained_draft(name: str, target, *, seed: int = 0):
    """``(a copy of the method's spec, a fresh draft from its shipped config)``, the same draft in every process
    (seeded, whatever ran before): the stand-in drafts of the mutant checks are built around it."""
    s = copy.deepcopy(spec(name))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return s, s.build_draft(target, None)


def sequences(target) -> list[list[int]]:
    """The corpus continued greedily by ``target`` (computed once per target and run, shared by the workers)."""
    if id(target) not in _SEQS:
        _SEQS[id(target)] = shared_json({"sequences": TRAIN_PROMPTS, "target": target_identity(target)},
                                        lambda: train_sequences(target))
    return _SEQS[id(target)]


# The powered sampling check (``checks.check_first_round_law``): a temperature at which tiny_random's top token
# holds ~0.4 of the mass on average, and a prompt from the drafts' training corpus (the corpus prompt plus
# four of the target's own tokens), where a trained draft's first slot has its best chance to be accepted.
FIRST_ROUND_T = 0.3
FIRST_ROUND_TRIALS = 300


def first_round_prompt(target) -> list[int]:
    return sequences(target)[1][: len(TRAIN_PROMPTS[1]) + 4]


def vocab_for(spec: MethodSpec, target, seqs: list[list[int]]):
    if spec.draft_vocab_size is None:
        return None
    freq = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=target.geometry.vocab_size)
    return build_vocab_mapping(freq, spec.draft_vocab_size)


def on_device(batch, device):
    """A batch's tensors on ``device``, as Lightning hands them to ``training_step`` (nested containers too)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: on_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(on_device(v, device) for v in batch)
    return batch


def quick_train(spec: MethodSpec, target, *, steps: int = TRAIN_STEPS, lr: float = TRAIN_LR):
    """A draft built from the config and trained ``steps`` optimizer steps (Adam) by the method's module.

    A method that trains a ``base`` method's draft starts, as it does in use, from the base's own
    (quickly trained) draft, and continues it at a fine-tuning rate: ``TRAIN_LR`` is a from-scratch rate,
    and over tiny_random's near-uniform next-token distributions (top probability ~0.005) a few steps at
    it move a trained draft's argmax far enough that nothing is accepted any more.

    Trained once per run for each (config, target, steps, rate), whichever test or worker asks first
    (``tests/draft_store.py``); every call returns its own copy."""
    recipe = {"steps": steps, "lr": lr, "prompts": TRAIN_PROMPTS, "seed": 0}
    return shared_draft(spec, target, recipe, lambda: _train(spec, target, steps=steps, lr=lr))


def _train(spec: MethodSpec, target, *, steps: int, lr: float):
    seqs = sequences(target)
    if spec.base is not None:
        draft = copy.deepcopy(quick_train(spec.base, target)).train()
        lr = min(lr, CONTINUE_LR)
    else:
        with torch.random.fork_rng():  # the same initial draft in every process, whatever ran before
            torch.manual_seed(0)
            draft = spec.build_draft(target, vocab_for(spec, target, seqs))
    # Several copies per sequence, so that the datamodule's validation split leaves training batches.
    samples = [RenderedSample(input_ids=s, loss_mask=[0] * (len(p) - 1) + [1] * (len(s) - len(p) + 1), id=f"{i}-{c}")
               for c in range(4) for i, (p, s) in enumerate(zip(TRAIN_PROMPTS, seqs))]
    module = spec.build_module(draft, target)
    dm = spec.build_datamodule(samples, features=None, pad_token_id=target.tokenizer.pad_token_id or 0, seed=0)
    dm.setup("fit")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(), _frozen_target_memo(module):
            torch.manual_seed(0)
            draft.train()
            step = 0
            while step < steps:
                for batch in dm.train_dataloader():
                    loss = module.training_step(on_device(batch, target.device), step)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    step += 1
                    if step == steps:
                        break
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


@contextmanager
def _frozen_target_memo(module):
    """For a plain EAGLE-3 module, whose target side is frozen: each batch's target features and the TTT's
    target-side tensors (``_TargetSide.of``, pure functions of the target's logits and the fixed vocabulary
    mapping) computed once and reused when the batch comes round again, as a long run over a small corpus does
    every few steps (the SSD checks' 300-step draft: a third of its time). The trained draft is the one the
    uncached loop trains (``test_the_frozen_target_memo_trains_the_same_draft``). Other modules (ConFu trains
    target-side soft prompts) run as they are."""
    from draftlab.methods.eagle3 import ttt
    from draftlab.methods.eagle3.module import Eagle3Module

    if type(module) is not Eagle3Module:
        yield
        return
    features: dict[bytes, tuple] = {}
    sides: dict[int, object] = {}
    plain_features, plain_of, descriptor = module.target_features, ttt._TargetSide.of, ttt._TargetSide.__dict__["of"]

    def target_features(batch):
        key = b"".join(batch[k].cpu().numpy().tobytes() for k in sorted(batch) if isinstance(batch[k], torch.Tensor))
        if key not in features:
            features[key] = plain_features(batch)
        return features[key]

    def of(draft, target_logits, chunk_rows=None):
        # Keyed by the logits tensor itself: only the memoised features' tensors (alive in ``features``) come back.
        if id(target_logits) not in sides:
            sides[id(target_logits)] = (target_logits, plain_of(draft, target_logits, chunk_rows))
        return sides[id(target_logits)][1]

    module.target_features = target_features
    ttt._TargetSide.of = of
    try:
        yield
    finally:
        del module.target_features
        ttt._TargetSide.of = descriptor


def first_losses(spec: MethodSpec, target, *, steps: int = 4, lr: float = 1e-3) -> list[float]:
    """Training losses of the first ``steps`` optimizer steps (Adam) of a seeded fresh draft: the numbers a
    change to a method's loss, data handling or initialisation moves (pinned in ``pinned_losses.json``)."""
    cfg = OmegaConf.create(OmegaConf.to_container(spec.cfg, resolve=True))
    # Few anchors where a config samples them: with one at every position of the tiny corpus, settings that
    # decide what a row between two anchors sees (ConFu's replication window) would not change the loss.
    if OmegaConf.select(cfg, "module.num_anchors", default=None) is not None:
        OmegaConf.update(cfg, "module.num_anchors", 3)
    spec = MethodSpec(cfg)
    seqs = sequences(target)
    samples = [RenderedSample(input_ids=s, loss_mask=[0] * (len(p) - 1) + [1] * (len(s) - len(p) + 1), id=f"{i}-{c}")
               for c in range(4) for i, (p, s) in enumerate(zip(TRAIN_PROMPTS, seqs))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses: list[float] = []
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            draft = spec.build_draft(target, vocab_for(spec, target, seqs))
            module = spec.build_module(draft, target)
            dm = spec.build_datamodule(samples, features=None, pad_token_id=target.tokenizer.pad_token_id or 0, seed=0)
            dm.setup("fit")
            opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
            draft.train()
            while len(losses) < steps:
                for batch in dm.train_dataloader():
                    loss = module.training_step(on_device(batch, target.device), len(losses))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
                    if len(losses) == steps:
                        break
    finally:
        torch.set_num_threads(threads)
    return losses
