"""Export of trained EAGLE-3 drafts for serving engines, and loading them back.

- ``native``: the ``LlamaForCausalLMEagle3`` layout, in one variant per engine: ``sglang`` (SGLang /
  SpecForge reading) and ``vllm`` (vLLM ``method: eagle3`` reading); the module docstring records where each
  engine reads each key.
- ``speculators``: the ``Eagle3Speculator`` layout that ``vllm serve <dir>`` detects.
- ``validate``: per-format validators that list every problem an engine would hit.
- ``lightning_ckpt``: drafts from the training module's Lightning checkpoints.
"""

from draftlab.export.convert import EXPORT_FORMATS, detect_source, export_checkpoint, load_draft
from draftlab.export.lightning_ckpt import draft_from_lightning_checkpoint
from draftlab.export.native import load_native, save_native, save_sglang, save_vllm
from draftlab.export.speculators import load_speculators, save_speculators
from draftlab.export.validate import (
    check_valid,
    validate_native,
    validate_sglang,
    validate_speculators,
    validate_vllm,
)

__all__ = ["EXPORT_FORMATS", "check_valid", "detect_source", "draft_from_lightning_checkpoint", "export_checkpoint",
           "load_draft", "load_native", "load_speculators", "save_native", "save_sglang", "save_speculators",
           "save_vllm", "validate_native", "validate_sglang", "validate_speculators", "validate_vllm"]
