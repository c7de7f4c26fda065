"""EAGLE-3 drafts in the serving engines' layouts, and loading them back.

- ``native``: the ``LlamaForCausalLMEagle3`` layout, in one variant per engine: ``sglang`` (SGLang /
  SpecForge reading) and ``vllm`` (vLLM ``method: eagle3`` reading); the module docstring records where each
  engine reads each key.
- ``speculators``: the ``Eagle3Speculator`` layout that ``vllm serve <dir>`` detects.
- ``validate``: per-format validators that list every problem an engine would hit.
- ``lightning``: drafts from the EAGLE-3 training module's Lightning checkpoints.
- ``convert``: any of these sources -> every format (``draftlab-export method=eagle3``, through the
  ``export.checkpoint`` entry of ``conf/method/eagle3.yaml``).
"""

from draftlab.methods.eagle3.export.convert import (
    EXPORT_FORMATS,
    detect_source,
    export_checkpoint,
    load_draft,
)
from draftlab.methods.eagle3.export.lightning import draft_from_lightning_checkpoint
from draftlab.methods.eagle3.export.native import load_native, save_native, save_sglang, save_vllm
from draftlab.methods.eagle3.export.speculators import load_speculators, save_speculators
from draftlab.methods.eagle3.export.validate import (
    check_valid,
    validate_native,
    validate_sglang,
    validate_speculators,
    validate_vllm,
)


def chain_knobs(k: int) -> dict[str, int]:
    """The drafter knobs of a chain of ``k`` draft tokens: what a served ``num_speculative_tokens: k`` drafts
    (one candidate per depth), so draftlab's τ is measured on the same shape as the engine's."""
    return {"branching": 1, "depth": int(k), "nodes": int(k)}


__all__ = ["EXPORT_FORMATS", "chain_knobs", "check_valid", "detect_source", "draft_from_lightning_checkpoint", "export_checkpoint",
           "load_draft", "load_native", "load_speculators", "save_native", "save_sglang", "save_speculators",
           "save_vllm", "validate_native", "validate_sglang", "validate_speculators", "validate_vllm"]
