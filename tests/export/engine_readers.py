"""Exported directories read the way each serving engine reads them, to run a draft chain without the engine.

The rules are those recorded in ``draftlab.methods.eagle3.export.native`` / ``.speculators`` (with the engine
source files they come from); nothing here uses draftlab's own loaders or the ``draftlab`` block:

- which target hidden states are fed as aux features: ``capture`` holds, per feature, the decoder layer whose
  *input* the engine captures (``hidden_states + residual`` before that layer runs), i.e. index ``capture[j]``
  of HF's ``output_hidden_states``;
- the final norm before lm_head: both engines always apply it;
- what is fed to the next draft step: the pre-norm state, or (vLLM ``norm_output: true``) the post-norm one;
- which layer switches and weights the engine builds (SGLang builds no ``fc_norm`` / ``input_norm`` and no
  ``norm_before_residual``; it would silently skip such weights, here that is an error).

``engine_chain`` runs the draft as the engine would on a prompt; ``draftlab_chain`` runs draftlab's own draft
object the way draftlab trains and decodes it; ``drafter_chain_tokens`` asks draftlab's ``Eagle3Drafter`` for
the chain it proposes in the first round of ``speculative_generate``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftlab.methods.eagle3 import Eagle3Config, Eagle3Draft
from draftlab.targets.base import PassRequest

AUX_KEY = "eagle_aux_hidden_state_layer_ids"


class EngineWouldMisread(ValueError):
    """The engine would load this directory but silently ignore part of it."""


@dataclass
class EngineDraft:
    engine: str
    draft: Eagle3Draft  # the weights the engine loads, built with the switches the engine reads
    capture: list[int]  # per aux feature: the layer whose input the engine captures (HF hidden_states index)
    feed_post_norm: bool  # the next draft step gets norm(h) instead of h


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _draft(sizes: dict, *, draft_vocab_size, target_hidden_size, num_layers: int, fc_norm: bool,
           norm_before_fc: bool, norm_before_residual: bool) -> Eagle3Draft:
    d, heads = int(sizes["hidden_size"]), int(sizes["num_attention_heads"])
    scaling = sizes.get("rope_scaling")
    return Eagle3Draft(Eagle3Config(
        hidden_size=d, intermediate_size=int(sizes["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(sizes.get("num_key_value_heads") or heads), head_dim=int(sizes.get("head_dim") or d // heads),
        vocab_size=int(sizes["vocab_size"]), draft_vocab_size=int(draft_vocab_size or sizes["vocab_size"]),
        rms_norm_eps=float(sizes["rms_norm_eps"]), rope_theta=float(sizes.get("rope_theta", 10000.0)),
        rope_scaling=scaling if scaling and scaling.get("rope_type", "default") != "default" else None,
        target_hidden_size=int(target_hidden_size or d), num_layers=num_layers, fc_norm=fc_norm,
        norm_before_fc=norm_before_fc, norm_before_residual=norm_before_residual,
        norm_output=True))  # engines always apply the final norm before lm_head


_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def _load(draft: Eagle3Draft, tensors: dict[str, torch.Tensor], rename, target, engine: str) -> None:
    """Load ``tensors`` (after ``rename``, which returns None for what the engine skips) strictly; the
    embedding comes from the target unless the file has one (both engines share the target's)."""
    draft.to(tensors["fc.weight"].dtype)  # engines run the draft in the checkpoint's dtype here
    own = draft.state_dict()
    loaded = {}
    for key, t in tensors.items():
        name = rename(key)
        if name is None:
            continue
        if name not in own:
            raise EngineWouldMisread(f"{engine} has no parameter for {key!r}")
        loaded[name] = t
    missing = set(own) - set(loaded) - {"embed_tokens.weight", "t2d"}
    if missing:
        raise EngineWouldMisread(f"{engine} would leave {sorted(missing)} at their initial values")
    with torch.no_grad():
        for name, t in loaded.items():
            own[name].copy_(t)
        if "embed_tokens.weight" not in loaded:
            draft.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    draft.eval()


def read_sglang(path, target, *, first_id_rule: bool = False) -> EngineDraft:
    """SGLang: ids from ``eagle_config`` only, captured at ``id + 1`` (``first_id_rule``: the newer model files'
    "add one only when the first id is 1"); final norm always, pre-norm state fed back; no norm switches."""
    path, L = Path(path), target.geometry.num_layers
    cfg = _config(path)
    ids = (cfg.get("eagle_config") or {}).get(AUX_KEY)
    if ids is None:
        capture = [2, L // 2, L - 3]
    elif first_id_rule and ids[0] != 1:
        capture = list(ids)
    else:
        capture = [i + 1 for i in ids]
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise EngineWouldMisread("SGLang's additional draft layers normalise with hidden_norm, which is not written")
    draft = _draft(cfg, draft_vocab_size=cfg.get("draft_vocab_size"), target_hidden_size=cfg.get("target_hidden_size"),
                   num_layers=1, fc_norm=False, norm_before_fc=False, norm_before_residual=False)
    tensors = load_file(str(path / "model.safetensors"))

    def rename(key):
        if key == "t2d":
            return None
        if key.startswith(("fc_norm.", "input_norm.")):
            raise EngineWouldMisread(f"SGLang builds no module for {key!r} and would skip it")
        return key

    _load(draft, tensors, rename, target, "sglang")
    return EngineDraft("sglang", draft, capture, feed_post_norm=False)


def _vllm_rename(key: str):
    if key == "t2d":
        return None  # vLLM skips it; d2t becomes draft_id_to_target_id
    if key.startswith("midlayer."):
        return key  # vLLM's mapper: midlayer. -> layers.0.
    m = _LAYER.fullmatch(key)
    if m:
        i = int(m.group(1))
        return ("midlayer." if i == 0 else f"additional_layers.{i - 1}.") + m.group(2)
    if key.startswith("additional_layers."):
        raise EngineWouldMisread(f"vLLM maps only midlayer. to layers.0.; {key!r} has no parameter")
    return key


def read_vllm(path, target, *, eagle_config_fallback: bool = True) -> EngineDraft:
    """vLLM ``method: eagle3`` on a native directory: top-level ids (then ``eagle_config``'s in builds that fall
    back to it; then the target's default), captured as given (input to that layer); ``norm_output`` selects
    the post-norm state as the fed-back one."""
    path, L = Path(path), target.geometry.num_layers
    cfg = _config(path)
    eagle = cfg.get("eagle_config") or {}
    ids = cfg.get(AUX_KEY) or (eagle.get(AUX_KEY) if eagle_config_fallback else None)
    capture = list(ids) if ids else [2, L // 2, L - 3]
    draft = _draft(cfg, draft_vocab_size=cfg.get("draft_vocab_size"), target_hidden_size=cfg.get("target_hidden_size"),
                   num_layers=int(cfg.get("num_hidden_layers", 1)), fc_norm=bool(cfg.get("fc_norm", False)),
                   norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    _load(draft, load_file(str(path / "model.safetensors")), _vllm_rename, target, "vllm")
    return EngineDraft("vllm", draft, capture, feed_post_norm=bool(cfg.get("norm_output", False)))


def read_speculators(path, target) -> EngineDraft:
    """vLLM on a speculators directory: ``update_eagle3`` copies the top-level keys (``norm_before_residual``
    default True, ``norm_output`` default False), then the model reads them as ``read_vllm`` does."""
    path, L = Path(path), target.geometry.num_layers
    cfg = _config(path)
    tl = cfg["transformer_layer_config"]
    ids = cfg.get(AUX_KEY)
    capture = list(ids) if ids else [2, L // 2, L - 3]
    draft = _draft(tl, draft_vocab_size=cfg.get("draft_vocab_size"), target_hidden_size=cfg.get("target_hidden_size"),
                   num_layers=int(tl.get("num_hidden_layers", 1)), fc_norm=bool(cfg.get("fc_norm", False)),
                   norm_before_fc=bool(cfg.get("norm_before_fc", False)),
                   norm_before_residual=bool(cfg.get("norm_before_residual", True)))
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("verifier_")}
    _load(draft, tensors, _vllm_rename, target, "vllm (speculators)")
    return EngineDraft("speculators", draft, capture, feed_post_norm=bool(cfg.get("norm_output", False)))


READERS = {"sglang": read_sglang, "vllm": read_vllm, "speculators": read_speculators}


# ------------------------------------------------------------------------------------------------------
# running a chain


def _chain(draft: Eagle3Draft, features: torch.Tensor, prompt: list[int], root: int, steps: int, *, logits_of,
           fed_back) -> tuple[torch.Tensor, list[int]]:
    """A greedy chain of ``steps`` draft tokens after ``prompt`` + ``root``; returns (logits [steps, V_d], tokens).

    Row j consumes token j+1 with feature j at position j (the last prompt row consumes the root); the depth-k
    node consumes draft token k-1 with the fed-back state of its parent row at position T-1+k. Every pass
    recomputes all rows under causal attention, which equals the engines' incremental decode with a KV cache
    (a row's keys depend on its own inputs only).
    """
    T = len(prompt)
    ids = list(prompt[1:]) + [root]
    hidden = draft.project(features)  # [1, T, d]
    logits_out, tokens = [], []
    target_ids = draft.target_ids()
    for _ in range(steps):
        pos = torch.arange(len(ids))[None]  # [1, R]
        h, _ = draft(torch.tensor([ids]), hidden, pos)  # [1, R, d]
        last = h[0, -1]  # [d]
        logits = logits_of(last)  # [V_d]
        token = int(target_ids[int(logits.argmax())])
        logits_out.append(logits)
        tokens.append(token)
        ids.append(token)
        hidden = torch.cat([hidden, fed_back(last)[None, None]], dim=1)
    assert len(ids) == T + steps
    return torch.stack(logits_out), tokens


@torch.no_grad()
def engine_chain(reader: EngineDraft, target, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The chain the engine would draft: HF hidden states at ``reader.capture``, the engine's norm rules."""
    out = target.model(torch.tensor([prompt]), output_hidden_states=True)
    states = out.hidden_states  # L + 1 entries: entry i is the input to layer i (the last one is post-norm)
    L = target.geometry.num_layers
    assert all(0 <= i < L for i in reader.capture), f"an engine cannot capture {reader.capture} of {L} layers"
    features = torch.cat([states[i] for i in reader.capture], dim=-1)  # [1, T, 3d]
    root = int(out.logits[0, -1].argmax())
    d = reader.draft
    return _chain(d, features, prompt, root, steps, logits_of=lambda h: d.lm_head(d.norm(h)),
                  fed_back=(lambda h: d.norm(h)) if reader.feed_post_norm else (lambda h: h))


@torch.no_grad()
def draftlab_chain(draft: Eagle3Draft, target, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The chain as draftlab trains and decodes the draft: its own taps and logits, the pre-norm state fed back."""
    draft.eval()
    out = target.forward(torch.tensor([prompt]), request=PassRequest(aux=draft.taps(target)))
    root = int(out.logits[0, -1].argmax())
    return _chain(draft, out.aux_hidden, prompt, root, steps, logits_of=draft.compute_logits, fed_back=lambda h: h)


@torch.no_grad()
def drafter_chain_tokens(draft: Eagle3Draft, target, prompt: list[int], steps: int) -> list[int]:
    """The chain ``Eagle3Drafter(branching=1, depth=steps)`` proposes in the first round of ``speculative_generate``."""
    from draftlab.decoding.engine import GenerationConfig, speculative_generate
    from draftlab.methods.eagle3.drafter import Eagle3Drafter

    drafter = Eagle3Drafter(draft, branching=1, depth=steps, nodes=steps)
    _, stats = speculative_generate(target, prompt, drafter, GenerationConfig(max_new_tokens=2, stop_on_eos=False),
                                    trace=True)
    round0 = stats.trace[0]
    tokens, parents = round0.tokens.tolist(), round0.parents.tolist()
    chain, node = [], 0
    while node in parents[1:]:
        node = parents.index(node, 1)
        chain.append(tokens[node])
    return chain
