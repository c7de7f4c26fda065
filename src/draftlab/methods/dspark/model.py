"""The DSpark draft: DFlash's parallel block pass, then a sequential low-rank Markov head and a confidence head.

The block pass is DFlash's (``DFlashDraft``): one forward over ``[anchor, MASK x (B-1)]`` gives every slot a
state ``h_k`` and base logits ``z_k = lm_head(h_k)`` at once. DSpark then drafts the slots left to right:

    logits_k = z_k + markov_w2 @ markov_w1[y_{k-1}]        y_0 = the anchor (the verified root)

``markov_w1`` (``V x r``) embeds the previously drafted token and ``markov_w2`` (``r x V``, stored as the
``[V, r]`` weight of a linear map) turns it into a vocabulary-sized transition bias: the intra-block
dependency the parallel pass cannot see, for ``2 V r`` parameters and one ``V x r`` product per slot.
The confidence head ``sigmoid(proj(h_k))`` estimates, per slot, the chance that the target accepts it
given that the slots before it were accepted; the drafter sizes each round's block from these estimates.

Module names are vLLM's (``markov_head.markov_w1``, ``markov_head.markov_w2``, ``confidence_head.proj``), so
the export is an identity map, like DFlash's. ``markov_w2`` starts at zero (PROPOSAL: vLLM ships no
initialisation): a fresh head adds no bias, so a DSpark draft built on a DFlash draft first drafts exactly
as that draft did, and training moves it from there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.methods.dflash.model import DFlashDraft
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.nn.placement import target_device


class MarkovHead(nn.Module):
    """The low-rank transition bias from the previously drafted token (see the module docstring)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r], vLLM's ParallelLMHead layout
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """Bias ``[.., V]`` for previous tokens ``prev [..]``."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit from the slot's final-norm state (no Markov input: see ``config``)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=True)
        # PROPOSAL: start at sigmoid(0) = 0.5 for every slot (vLLM ships no initialisation).
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..]`` of slot states ``[.., d]``, in fp32 as vLLM computes them."""
        return F.linear(hidden.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """DFlash draft + ``markov_head`` + optional ``confidence_head``. ``target``: move to its device and share
    its embedding / LM head now."""

    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig, target=None):
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size) if config.enable_confidence_head else None
        if target is not None:
            self.to(target_device(target)).share_target_weights(target)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Transition bias ``[.., V]`` added to a slot's base logits, given the token drafted before it ``[..]``."""
        return self.markov_head(prev).to(self.fc.weight.dtype)

    def confidence(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Per-slot acceptance estimates in ``(0, 1)`` ``[..]`` (fp32) from slot states ``[.., d]``; None without
        a confidence head."""
        if self.confidence_head is None:
            return None
        return torch.sigmoid(self.confidence_head(hidden))

    @classmethod
    def from_dflash(cls, base: DFlashDraft, *, markov_rank: int, enable_confidence_head: bool = True,
                    seed: int | None = None) -> DSparkDraft:
        """A DSpark draft whose block pass is ``base``'s (its weights copied) and whose heads are fresh: with the
        zero-initialised ``markov_w2`` it drafts greedily exactly as ``base`` does. ``seed``: of the heads' init."""
        config = DSparkConfig.from_dflash(base.config, markov_rank=markov_rank,
                                          enable_confidence_head=enable_confidence_head)
        with torch.random.fork_rng(enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            draft = cls(config)  # drawn on the CPU: a seed gives the same heads on any device
        w = base.fc.weight
        draft.to(device=w.device, dtype=w.dtype)
        missing, unexpected = draft.load_state_dict(base.state_dict(), strict=False)
        fresh = [k for k in missing if not k.startswith(("markov_head.", "confidence_head."))]
        if fresh or unexpected:
            raise ValueError(f"the DFlash draft does not fit DSpark's block pass: missing {fresh}, unexpected {unexpected}")
        if base.embed_weight is not None:
            draft.embed_weight, draft.lm_head_weight, draft.lm_head_bias = (
                base.embed_weight, base.lm_head_weight, base.lm_head_bias)
        return draft
