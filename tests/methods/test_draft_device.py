"""Everything a run creates lives on the target's device: drafts built, continued and loaded, the drafters'
caches, and the features they read every round.

Checked on the CPU with a ``meta`` target (tiny_random honours ``device``): a draft built or loaded on the CPU
shows by its device, and a meta tensor cannot be copied to the host, so a drafter that copied the target's
features there would raise. Drafting itself needs values (trees are chosen by them), so one test runs every
method for real and records the host tensors the drafters make: none may grow with the context. On a CUDA
machine (``gpu``), every method's draft is built, saved and loaded beside a GPU target and decodes as the
target does, with no GPU tensor the size of the context copied to the host while drafting.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.configs import compose_train_config
from draftlab.data.vocab import build_vocab_mapping
from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.registry import MethodSpec
from draftlab.targets import load_target
from tests.decoding.conformance.methods import METHODS, spec

META = torch.device("meta")
TRAINABLE = [n for n in METHODS if spec(n).trainable]
# Loading into meta parameters is a no-op torch warns about; the device is what these tests read.
pytestmark = pytest.mark.filterwarnings("ignore:.*meta parameter.*:UserWarning")


@pytest.fixture(scope="module")
def meta_target():
    return load_target("tiny_random", device="meta")


def module_devices(module: torch.nn.Module) -> set[torch.device]:
    return {t.device for t in (*module.parameters(), *module.buffers())}


def _vocab(s: MethodSpec, target):
    if s.draft_vocab_size is None:
        return None
    V = target.geometry.vocab_size
    return build_vocab_mapping(torch.arange(V, 0, -1, dtype=torch.float), s.draft_vocab_size)


def _own(s: MethodSpec) -> MethodSpec:
    """A private copy of a (cached) method config, to edit."""
    return MethodSpec(OmegaConf.create(OmegaConf.to_container(s.cfg, resolve=True)))


@pytest.fixture(scope="module")
def saved(tiny_target, tmp_path_factory):
    """name -> the artifact directory of a fresh draft of that method, built with the test target."""
    dirs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in dirs:
            s = spec(name)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                draft = s.build_draft(tiny_target, _vocab(s, tiny_target))
            dirs[name] = s.save(draft, tmp_path_factory.mktemp(name) / "draft", tiny_target)
        return dirs[name]

    return get


def _aux(drafter, target, rows: int) -> torch.Tensor:
    """Tapped target features of ``rows`` positions, on the target's device (values do not matter)."""
    taps = drafter.taps(target)
    return torch.zeros(rows, len(taps) * target.geometry.hidden_size, device=target.device)


def _state(target, aux: torch.Tensor | None, prompt: int = 12) -> DecodeState:
    return DecodeState(target=target, cache=target.new_cache(1, prompt + 64), tokens=list(range(5, 6 + prompt)),
                       prompt_len=prompt, temperature=0.0, accepted_aux=aux)


# ---- built, continued, loaded ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_fresh_draft_is_built_on_the_targets_device(meta_target, name):
    s = spec(name)
    draft = s.build_draft(meta_target, _vocab(s, meta_target))
    assert module_devices(draft) == {META}


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_loaded_draft_is_on_the_targets_device(meta_target, tiny_target, saved, name):
    s = spec(name)
    assert module_devices(s.load(saved(name), meta_target)) == {META}
    assert module_devices(s.load(saved(name), tiny_target)) == {tiny_target.device}


# (method, where its config names the draft it continues, the method whose artifact that is)
CONTINUED = [("eagle3", "draft.init.from", "eagle3"), ("draft_opd", "base.draft.init.from", "eagle3"),
             ("confu", "draft.init_from", "eagle3"), ("confu", "draft.init.from", "confu"),
             ("dflash", "draft.init.from", "dflash")]


@pytest.mark.parametrize(("name", "field", "start"), CONTINUED)
def test_a_continued_draft_is_on_the_targets_device(meta_target, saved, name, field, start):
    s = _own(spec(name))
    OmegaConf.update(s.cfg, field, str(saved(start)), force_add=True)
    assert module_devices(s.build_draft(meta_target, _vocab(s, meta_target))) == {META}


def test_the_export_loaders_place_the_draft(meta_target, tiny_target, saved, tmp_path):
    from draftlab.methods.eagle3.export import load_draft, load_speculators, save_speculators
    from draftlab.methods.eagle3.export.lightning import draft_from_lightning_checkpoint

    native = saved("eagle3")
    assert module_devices(load_draft(native, target=meta_target)) == {META}
    # A target factory is built for the embedding, and the draft joins it.
    assert module_devices(load_draft(native, target=lambda: meta_target)) == {META}
    # Without a target: the CPU, unless a device is asked for.
    assert module_devices(load_draft(native, require_embedding=False)) == {torch.device("cpu")}
    assert module_devices(load_draft(native, require_embedding=False, device="meta")) == {META}
    assert module_devices(load_draft(native, target=tiny_target, device="meta")) == {META}

    draft = load_draft(native, target=tiny_target)
    save_speculators(draft, tmp_path / "spec", max_position_embeddings=4096)
    assert module_devices(load_speculators(tmp_path / "spec", target=meta_target)) == {META}
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"draft.{k}": v.cpu() for k, v in draft.state_dict().items()
                               if k != "embed_tokens.weight"},
                "eagle3_config": draft.config.to_dict()}, ckpt)
    assert module_devices(draft_from_lightning_checkpoint(ckpt, target=meta_target)) == {META}


def test_trainable_baselines_draft_from_the_runs_draft_on_the_targets_device(meta_target, saved):
    from draftlab.stages.evaluate import baseline_drafters

    cfg = compose_train_config(["method=eagle3", "target=tiny_random", "+method@eval.baselines.sfx=eagle3_suffix",
                                "+method@eval.baselines.pld=prompt_lookup"])
    draft = MethodSpec(cfg.method).load(saved("eagle3"), meta_target)
    drafters, _ = baseline_drafters(cfg, MethodSpec(cfg.method), draft)
    learned = drafters["sfx"][0].learned
    assert module_devices(learned.compute_draft) == {META} and learned.rows.device == META


# ---- no silent mixing ------------------------------------------------------------------------------------


def test_dflash_refuses_to_share_the_weights_of_a_target_on_another_device(tiny_target, meta_target):
    from draftlab.methods.dflash import build_draft

    draft = build_draft(tiny_target, num_layers=1, block_size=4, seed=0)
    with pytest.raises(ValueError) as err:
        draft.share_target_weights(meta_target)
    msg = str(err.value)
    assert "\n" not in msg and "meta" in msg and str(tiny_target.device) in msg


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_drafter_refuses_a_draft_that_is_not_on_the_targets_device(tiny_target, meta_target, name):
    # Its cache would be made beside the draft and every round's features copied over: an error instead.
    s = spec(name)
    drafter = s.build_drafter(s.build_draft(tiny_target, _vocab(s, tiny_target)))
    aux = _aux(drafter, meta_target, 12) if drafter.taps(meta_target) is not None else None
    with pytest.raises(ValueError, match="meta"):
        drafter.reset(_state(meta_target, aux))


# ---- the draft cache and the features of every round ----------------------------------------------------


# SSD's feature base keeps its cache in its outcome drafter (the test below).
FEATURE_DRAFTERS = [n for n in TRAINABLE if not n.startswith(("confu", "specbound", "ssd"))]


@pytest.mark.parametrize("name", FEATURE_DRAFTERS)
def test_the_draft_cache_is_made_on_the_targets_device_from_features_left_there(meta_target, saved, name):
    # ``reset`` runs the draft over the prompt's features into its cache; a meta feature copied to the host
    # would raise ("cannot copy out of meta tensor").
    s = spec(name)
    drafter = s.build_drafter(s.load(saved(name), meta_target))
    drafter.reset(_state(meta_target, _aux(drafter, meta_target, 12)))
    learned = getattr(drafter, "learned", drafter)  # a hybrid's learned part
    cache = getattr(learned, "_ctx", None) or learned.cache  # DFlash's context K/V | EAGLE-3's draft KV
    assert cache.k.device == META and cache.v.device == META


def test_the_eagle3_outcome_drafter_keeps_its_cache_beside_the_target(meta_target, saved):
    # What SSD's worker copy computes every round: the verified rows from features left on the target's device,
    # then drafting rows past them, all on that device.
    s = spec("eagle3")
    drafter = s.build_drafter(s.load(saved("eagle3"), meta_target))
    outcome_drafter = drafter.outcome_drafter(meta_target)
    state = _state(meta_target, _aux(drafter, meta_target, 12))
    outcome_drafter.absorb(outcome_drafter.verified(state))
    z = outcome_drafter.glue(state.tokens, [5, 6, 7])  # [4, V]
    assert outcome_drafter.rows.cache.k.device == META and z.device == META and z.shape[0] == 4


def test_confu_keeps_its_future_token_and_draft_cache_beside_the_target(meta_target, saved):
    # ConFu's reset needs a real target pass (the contemplate row); what follows it every round does not:
    # the future token from the contemplate row's features, and the accepted rows appended with it.
    s = spec("confu")
    drafter = s.build_drafter(s.load(saved("confu"), meta_target))
    p = 12
    aux = _aux(drafter, meta_target, p)
    future = drafter._future_for(aux[-1], aux[-1], p - 1)
    assert all(k.device == META and v.device == META for k, v in future)
    drafter._future, drafter._future_anchor, drafter._next_future = None, -1, (future, p - 1)
    drafter.tree.start(_state(meta_target, aux, p), drafter._append_side(p, 0))
    assert drafter.cache.k.device == META


# ---- host tensors made while drafting --------------------------------------------------------------------


# Training-free lookups whose search runs on the host token list (the tree they return is what moves).
HOST_SEARCH = {"prompt_lookup"}
FACTORIES = ("tensor", "zeros", "ones", "full", "empty", "arange", "eye", "rand", "randn", "randint", "linspace")
PROMPT = 2048


@contextmanager
def host_tensors_made_in(folder: str, monkeypatch):
    """Records ``(factory, file:line, numel)`` of every tensor a torch factory makes without ``device=`` when
    called from a file under ``folder``."""
    made: list[tuple[str, str, int]] = []
    for name in FACTORIES:
        real = getattr(torch, name)

        def factory(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            if kwargs.get("device") is None:
                code = sys._getframe(1)
                if folder in code.f_code.co_filename.replace("\\", "/"):
                    made.append((_name, f"{Path(code.f_code.co_filename).name}:{code.f_lineno}", out.numel()))
            return out

        monkeypatch.setattr(torch, name, factory)
    try:
        yield made
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", METHODS)
def test_no_drafter_makes_a_host_tensor_that_grows_with_the_context(tiny_target, monkeypatch, name):
    # Host bookkeeping of a tree's size is fine (trees are built on the host and the engine moves them); a
    # host tensor the size of the context (EAGLE-3's tree attention mask, ConFu's prompt rows' future
    # mask) is copied to the target's device every round. Training-free lookups (prompt lookup, suffix
    # tries) search the token list on the host by design and never meet the target's tensors: left out.
    if name in HOST_SEARCH:
        pytest.skip(f"{name} searches the token list on the host by design; nothing it makes goes to the device")
    s = spec(name)
    drafter = s.build_drafter(s.build_draft(tiny_target, _vocab(s, tiny_target))) if s.trainable else s.build_drafter()
    prompt = ([5, 6, 7, 8, 9] * (PROMPT // 5 + 1))[:PROMPT]  # repetitive: the lookups find matches too
    cfg = GenerationConfig(max_new_tokens=6, temperature=0.0, stop_on_eos=False)
    with host_tensors_made_in("draftlab/methods/", monkeypatch) as made:
        speculative_generate(tiny_target, prompt, drafter, cfg)
    big = sorted({(f, where, n) for f, where, n in made if n >= PROMPT // 2})
    assert not big, f"host tensors the size of the context, made while drafting: {big}"


# ---- on a GPU: the whole path, as a run takes it ---------------------------------------------------------


@contextmanager
def copies_to_the_host_from(folder: str, monkeypatch):
    """Records ``(how, file:line, numel)`` of every copy of a GPU tensor to the host (``.cpu()``, ``.to(...)``,
    ``.tolist()``) made from a file under ``folder``."""
    copies: list[tuple[str, str, int]] = []

    def record(how, t):
        code = sys._getframe(2)
        if t.is_cuda and folder in code.f_code.co_filename.replace("\\", "/"):
            copies.append((how, f"{Path(code.f_code.co_filename).name}:{code.f_lineno}", t.numel()))

    real_cpu, real_to, real_tolist = torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.tolist

    def cpu(self, *args, **kwargs):
        record("cpu", self)
        return real_cpu(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.device.type == "cpu":
            record("to", self)
        return out

    def tolist(self):
        record("tolist", self)
        return real_tolist(self)

    for name, fn in (("cpu", cpu), ("to", to), ("tolist", tolist)):
        monkeypatch.setattr(torch.Tensor, name, fn)
    try:
        yield copies
    finally:
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("name", METHODS)
def test_on_a_gpu_a_loaded_draft_decodes_as_the_target_without_host_copies(name, monkeypatch, tmp_path):
    from draftlab.decoding.engine import autoregressive_generate

    target = load_target("tiny_random", device="cuda")
    s = spec(name)
    if s.trainable:
        draft = s.build_draft(target, _vocab(s, target))
        assert {d.type for d in module_devices(draft)} == {"cuda"}
        draft = s.load(s.save(draft, tmp_path / "draft", target), target)
        assert {d.type for d in module_devices(draft)} == {"cuda"}
        drafter = s.build_drafter(draft.to(target.dtype).eval())  # as stages/pipeline.py does
    else:
        drafter = s.build_drafter()
    prompt = ([5, 6, 7, 8, 9] * (PROMPT // 5 + 1))[:PROMPT]
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, stop_on_eos=False)
    with copies_to_the_host_from("draftlab/methods/", monkeypatch) as copies:
        out, _ = speculative_generate(target, prompt, drafter, cfg)
    assert out == autoregressive_generate(target, prompt, cfg)[0]
    big = sorted({c for c in copies if c[2] >= PROMPT // 2})
    assert not big, f"GPU tensors the size of the context copied to the host while drafting: {big}"
