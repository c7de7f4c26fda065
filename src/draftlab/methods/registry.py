"""The method registry: everything the pipeline needs of a method, declared in ``conf/method/<m>.yaml``.

The stages never name a method. They read a method through :class:`MethodSpec`, whose members map one to
one onto the config file's blocks (each a Hydra ``_target_``, most with ``_partial_: true`` because the
pipeline supplies the run-time arguments)::

    name / label / trainable        identity; ``trainable: false`` = no draft artifact (training-free)
    draft_vocab_size                the reduced draft vocabulary the data stage builds (null: none; ``auto``:
                                    sized from the target's vocabulary, see :func:`auto_draft_vocab_size`)
    taps                            target layers the method reads (null: the method's default)
    draft(target=, vocab=, taps=)   builds the draft nn.Module (fresh, or continued from an artifact)
    module(draft=, target=)         the LightningModule that trains / calibrates it
    data(samples=, feature_dir=, pad_token_id=, seed=)   its LightningDataModule
    features(target=, draft=, samples=, root=, key=)  offline target features -> a directory; null = online
    artifact.save(draft, out_dir, target=) / artifact.load(path, target=)   the trained-draft artifact
    export                          serving formats (``draftlab-export``):
      formats.<f>(draft, out_dir, target=, ...)    writes format f (its other keywords: the export settings)
      validate.<f>(path[, target=])                the problems found in a written f directory (none: valid)
      aliases: {name: f | all}                     other names of formats
      checkpoint(checkpoint, out, format=, target=, ...)   optional: the method's own checkpoint -> formats
    drafter(draft) | drafter()      the inference-time drafter the engine calls
    axes                            name -> dotted path in this config: the settings tables compare by
    ci                              small knobs for CPU tests (``from_name(..., ci=True)``); never read by a run

A method built on another names it as a nested ``base`` method config (``- /method@base: eagle3`` in its
defaults): Draft-OPD trains its base's draft on policy, SSD drafts with its base's drafter. Every block it
does not declare itself (the draft, its training, artifact, exports, drafter, draft vocabulary, taps) is the
base's, so a draft it trains is saved, exported and decoded exactly as the base's own; the base's axes come
first and the method's own on top (``axes: {nodes: null}`` drops one the method does not read). ``monitor`` names the validation metric the best checkpoint is chosen by.

A method is then one folder under ``methods/`` plus its config files; a new one needs no pipeline edit.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

# Blocks that do not change the weights a training run produces (so they stay out of the training key).
_NOT_IN_TRAIN_KEY = ("label", "drafter", "export", "artifact", "axes", "features", "ci")
# Module settings that choose how, not what, the loss is computed (the same op in another kernel).
_MODULE_NOT_IN_TRAIN_KEY = ("attention", "cross_entropy")
# Draft settings added after drafts were keyed, whose null is what those drafts were trained with: left out of the
# key while null, so every draft trained before them keeps its key (and is reused).
_DRAFT_UNKEYED_WHEN_NULL = ("sliding_window",)



_ABSENT = object()

# The metric a run's best checkpoint is chosen by unless the method names another (``monitor:``).
DEFAULT_MONITOR = "val/simulated_tau"

AUTO = "auto"


def auto_draft_vocab_size(vocab_size: int) -> int:
    """The draft vocabulary ``draft_vocab_size: auto`` stands for, given the target's vocabulary ``V``.

    32,000 for a large vocabulary (V >= 100,000: Llama 3's 128,256, Qwen's 151,936), as the published EAGLE-3
    recipes use (EAGLE-3's Llama-3.1-8B draft and SpecForge's Llama 3 / Qwen configs: draft_vocab_size 32000);
    otherwise min(V, 8,192), the size this project used for every target so far (SmolLM2's V = 49,152 keeps
    8,192, and with it every existing vocabulary map and training key).
    """
    vocab_size = int(vocab_size)
    if vocab_size <= 0:
        raise ValueError(f"target vocabulary size must be positive, got {vocab_size}")
    return 32000 if vocab_size >= 100_000 else min(vocab_size, 8192)


def resolve_draft_vocab_size(value, vocab_size: int | None) -> int | None:
    """A configured ``draft_vocab_size`` as the number it stands for: null stays None (no reduced vocabulary),
    an integer is itself, ``auto`` is :func:`auto_draft_vocab_size` of the target's ``vocab_size``."""
    if value is None:
        return None
    if str(value) == AUTO:
        if vocab_size is None:
            raise ValueError("draft_vocab_size: auto needs the target's vocabulary size")
        return auto_draft_vocab_size(vocab_size)
    if isinstance(value, bool) or not str(value).lstrip("-").isdigit():
        raise ValueError(f"draft_vocab_size must be an integer, 'auto' or null, got {value!r}")
    return int(value)


class MethodSpec:
    """A composed ``method`` config node, with one call per pipeline seam."""

    def __init__(self, cfg: DictConfig):
        if "name" not in cfg:
            raise ValueError("method config has no 'name'")
        self.cfg = cfg

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def from_name(cls, name: str, overrides: list[str] | tuple[str, ...] = (), *, target: str = "tiny_random",
                  ci: bool = False) -> MethodSpec:
        """Compose ``conf/method/<name>.yaml`` inside the real primary config (for tests and scripts).

        ``ci``: with the method's ``ci`` block (and its base's) merged in: the small knobs the config
        declares for CPU tests, so a test suite sizes every method without naming its settings."""
        from draftlab.configs import compose_train_config

        cfg = compose_train_config([f"method={name}", f"target={target}", *overrides])
        spec = cls(cfg.method)
        if spec.needs_vocab_size:
            from draftlab.targets.config_facts import target_hf_config

            spec.resolve_draft_vocab(target_hf_config(cfg.target).config.vocab_size)
        if ci:
            apply_ci(spec.cfg)
        return spec

    # ---- identity ----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self.cfg.name)

    @property
    def label(self) -> str:
        return str(self.cfg.get("label") or self.cfg.name)

    @property
    def trainable(self) -> bool:
        return bool(self.cfg.get("trainable", False))

    @property
    def draft_vocab_size(self) -> int | None:
        v = self.block("draft_vocab_size")
        if v is not None and str(v) == AUTO:
            raise ValueError(f"method '{self.name}': draft_vocab_size is 'auto' until the target's vocabulary is "
                             "known (MethodSpec.resolve_draft_vocab)")
        return resolve_draft_vocab_size(v, None)

    @property
    def needs_vocab_size(self) -> bool:
        """Some ``draft_vocab_size`` in this config (or a nested method's) is still ``auto``."""
        return bool(_auto_vocab_paths(self.cfg))

    def resolve_draft_vocab(self, vocab_size: int) -> MethodSpec:
        """Replace every ``draft_vocab_size: auto`` in this config (and in a nested method config: a
        base) by the number it stands for with a target of ``vocab_size`` tokens, in place: the composed
        run config then holds the number, so every key, record and reader sees what an explicit value would
        give. Returns ``self``."""
        from omegaconf import read_write

        for path in _auto_vocab_paths(self.cfg):
            with read_write(self.cfg):
                OmegaConf.update(self.cfg, path, auto_draft_vocab_size(vocab_size), merge=False)
        return self

    def for_target(self, target) -> MethodSpec:
        """:meth:`resolve_draft_vocab` with ``target``'s vocabulary where anything is still ``auto``; ``self``."""
        if self.needs_vocab_size:
            self.resolve_draft_vocab(target.geometry.vocab_size)
        return self

    @property
    def taps(self) -> list[int] | None:
        t = self.block("taps")
        return None if t is None else [int(i) for i in t]

    @property
    def monitor(self) -> str:
        """The validation metric (higher is better) the best checkpoint is chosen by."""
        return str(self.cfg.get("monitor") or DEFAULT_MONITOR)

    @property
    def base(self) -> MethodSpec | None:
        """The nested method this one is built on (``base:`` block), or None."""
        node = self.cfg.get("base")
        return MethodSpec(node) if node is not None else None

    def resolved(self) -> dict[str, Any]:
        return OmegaConf.to_container(self.cfg, resolve=True)

    def key_config(self) -> dict[str, Any]:
        """The slice of the method config that changes the trained weights (enters the training key)."""
        def how(block):  # a module block without its kernel choices (a wrapper's module nests its base's)
            if not isinstance(block, dict):
                return block
            return {k: how(v) for k, v in block.items() if k not in _MODULE_NOT_IN_TRAIN_KEY}

        def keyed(cfg: dict) -> dict:
            out = {k: v for k, v in cfg.items() if k not in _NOT_IN_TRAIN_KEY}
            if "module" in out:
                out["module"] = how(out["module"])
            if isinstance(out.get("draft"), dict):
                out["draft"] = {k: v for k, v in out["draft"].items()
                                if not (k in _DRAFT_UNKEYED_WHEN_NULL and v is None)}
            return out

        out = keyed(self.resolved())
        if isinstance(out.get("base"), dict):
            out["base"] = keyed(out["base"])
        return out

    def block(self, key: str, default=None):
        """``key`` of this config, or of the base's when this one does not declare it."""
        if key in self.cfg or "base" not in self.cfg:
            return self.cfg.get(key, default)
        return self.cfg.base.get(key, default)

    def axes(self, trained: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{axis: value}`` for the comparison axes this method declares (``axes: {nodes: drafter.nodes}``).

        ``trained``: the method config the evaluated draft was trained with (:func:`trained_method_config`).
        An axis on a training setting (``draft.block_size``, ``module.ttt_length``: anything outside the
        blocks that leave the weights alone) then reports the draft's value, not this config's: a block-4
        DFlash draft evaluated under a block-8 config drafts blocks of 4."""
        out = {}
        # A base's axes first (paths inside the base's config), then the method's own on top.
        owners = ([(self.cfg.base, True)] if "base" in self.cfg else []) + [(self.cfg, False)]
        for owner, is_base in owners:
            source = _trained_part(trained, is_base=is_base, wraps_base="base" in self.cfg)
            for axis, path in (owner.get("axes") or {}).items():
                if path is None:  # the method does not read its base's setting: not an axis of this method
                    out.pop(str(axis), None)
                    continue
                value = OmegaConf.select(owner, str(path), throw_on_missing=False, default=_ABSENT)
                if value is _ABSENT:
                    raise ValueError(f"method '{self.name}': axis '{axis}' points at '{path}', which the config lacks")
                if source is not None and str(path).split(".")[0] not in _NOT_IN_TRAIN_KEY:
                    value = OmegaConf.select(OmegaConf.create(source), str(path), default=value)
                out[str(axis)] = value  # null is a setting too (a default the method resolves itself)
        return out

    # ---- seams -------------------------------------------------------------------------------------

    def _block(self, key: str):
        block = self.block(key)
        if block is None:
            raise ValueError(f"method '{self.name}' declares no '{key}' block in conf/method/")
        return block

    def build_draft(self, target, vocab=None):
        return instantiate(self._block("draft"))(target=target, vocab=vocab, taps=self.taps)

    def build_module(self, draft, target):
        return instantiate(self._block("module"))(draft=draft, target=target)

    def build_datamodule(self, samples, *, features: Path | None, pad_token_id: int, seed: int):
        return instantiate(self._block("data"))(samples=samples, feature_dir=features, pad_token_id=pad_token_id,
                                                seed=seed)

    @property
    def has_offline_features(self) -> bool:
        return self.block("features") is not None

    def prepare_features(self, *, target, draft, samples, root: Path, key: tuple) -> Path | None:
        """The offline feature store for these samples (computed once, shared by every run on them)."""
        if not self.has_offline_features:
            return None
        return instantiate(self.block("features"))(target=target, draft=draft, samples=samples, root=root, key=key)

    def save(self, draft, out_dir: Path, target) -> Path:
        return instantiate(self._block("artifact").save)(draft, out_dir, target=target)

    def load(self, path: Path, target):
        return instantiate(self._block("artifact").load)(path, target=target)

    # ---- exports (``draftlab-export``) ---------------------------------------------------------------

    def _export_part(self, key: str) -> dict[str, Any]:
        # A null entry drops what the config it extends declares (DFlash2 does not write DFlash's format).
        return {k: v for k, v in ((self.block("export") or {}).get(key) or {}).items() if v is not None}

    @property
    def export_formats(self) -> list[str]:
        """The serving formats the ``export`` block declares, in its order."""
        return [str(k) for k in self._export_part("formats")]

    @property
    def exporters(self) -> dict[str, Any]:
        """``{format: writer}``: each ``writer(draft, out_dir, target=, ...)``."""
        return {str(k): instantiate(v) for k, v in self._export_part("formats").items()}

    @property
    def export_aliases(self) -> dict[str, str]:
        """``{alias: format or 'all'}``."""
        return {str(k): str(v) for k, v in self._export_part("aliases").items()}

    def resolve_export_format(self, format: str) -> list[str]:
        """The formats ``format`` stands for: one declared format, an alias of one, or ``all`` (every one).

        ``ConfigError`` naming this method's formats for anything else."""
        from draftlab.utils.errors import ConfigError

        formats = self.export_formats
        if not formats:
            raise ConfigError(f"method '{self.name}' declares no export formats (conf/method/ 'export.formats')",
                              field="format")
        aliases = self.export_aliases
        canonical = aliases.get(str(format), str(format))
        if canonical == "all":
            return formats
        if canonical not in formats:
            names = ", ".join([*formats, "all", *aliases])
            raise ConfigError(f"method '{self.name}' has no export format '{format}'; its formats: {names}",
                              field="format")
        return [canonical]

    def export(self, format: str, draft, out_dir: Path, *, target=None, **settings) -> Path:
        """Write ``draft`` as ``format`` into ``out_dir``. ``settings`` (dtype, max_position_embeddings, ...)
        reach the writer where it takes them; the others are left out (they belong to other methods' formats)."""
        (fmt,) = self.resolve_export_format(format)
        writer = instantiate(self._export_part("formats")[fmt])
        return call_with_settings(writer, draft, out_dir, target=target, **settings)

    def validate_export(self, format: str, path: Path, *, target=None) -> list[str]:
        """Every problem the format's validator finds in ``path`` (empty: valid, or no validator declared)."""
        (fmt,) = self.resolve_export_format(format)
        node = self._export_part("validate").get(fmt)
        if node is None:
            return []
        return list(call_with_settings(instantiate(node), path, target=target))

    @property
    def checkpoint_exporter(self):
        """The method's own ``(checkpoint, output_dir, format=, target=, ...) -> {format: dir}``, or None
        (then ``draftlab.export`` loads the checkpoint through the method and writes each format)."""
        node = (self.block("export") or {}).get("checkpoint")
        return None if node is None else instantiate(node)

    def build_drafter(self, draft=None):
        factory = instantiate(self._block("drafter"))
        return factory(draft) if self.trainable else factory


def _auto_vocab_paths(node: DictConfig) -> list[str]:
    """Dotted paths of the ``draft_vocab_size`` settings written as ``auto`` (not interpolations) in ``node``."""
    raw = OmegaConf.to_container(node, resolve=False)
    found: list[str] = []

    def walk(value, prefix: str) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                if key == "draft_vocab_size" and isinstance(child, str) and child == AUTO:
                    found.append(f"{prefix}{key}")
                else:
                    walk(child, f"{prefix}{key}.")

    walk(raw, "")
    return found


def apply_ci(method_cfg: DictConfig) -> None:
    """Merge a method config's ``ci`` block (and its base's) into it, in place: the small knobs the method
    declares for CPU tests."""
    for node in (method_cfg, method_cfg.get("base")):
        if node is not None:
            _merge_settings(node, node.get("ci"))


def _merge_settings(node: DictConfig, settings, prefix: str = "") -> None:
    """Set every leaf of ``settings`` (a nested mapping, or None) at the same path in ``node``."""
    for key, value in (settings or {}).items():
        if OmegaConf.is_dict(value):
            _merge_settings(node, value, f"{prefix}{key}.")
        else:
            OmegaConf.update(node, f"{prefix}{key}", value, merge=False)


def call_with_settings(fn, *args, **settings):
    """``fn(*args, **settings)`` with only the keywords ``fn`` takes (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        settings = {k: v for k, v in settings.items() if k in names}
    return fn(*args, **settings)


def trained_method_config(draft_dir: Path | str | None) -> dict[str, Any] | None:
    """The method config a trained draft artifact was made with (``<artifact>/train_config.json``, beside its
    ``draft/`` directory), or None for a draft from elsewhere (no such file)."""
    if draft_dir is None:
        return None
    path = Path(draft_dir).parent / "train_config.json"
    if not path.exists():
        return None
    import json

    try:
        return json.loads(path.read_text())["method"]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a training config with a 'method' block ({exc})") from exc


def _trained_part(trained: dict[str, Any] | None, *, is_base: bool, wraps_base: bool) -> dict | None:
    """The part of ``trained`` (an artifact's method config) that holds the settings of one axes owner: the
    draft's own config (a base's, when a wrapper such as Draft-OPD trained it) for the evaluated method or
    its base; the wrapper's config for a wrapper's own axes, if the draft was trained by one."""
    if trained is None:
        return None
    draft_own = trained.get("base") or trained
    if is_base or not wraps_base:
        return draft_own
    return trained if "base" in trained else None


def method_names() -> list[str]:
    """Every method config shipped in ``conf/method/``."""
    from draftlab.configs import config_dir

    return sorted(p.stem for p in (Path(config_dir()) / "method").glob("*.yaml"))
