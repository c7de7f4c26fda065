"""DFlash (arXiv 2602.06036): a block-diffusion draft that proposes a whole block in one forward pass.

``model.DFlashDraft`` (fused target context as extra K/V in every layer, the target's embedding and LM head
shared and frozen), ``blocks`` (random-anchor training blocks and the weighted loss), ``module.DFlashModule``
(LightningModule), ``data.DFlashDataModule``, ``drafter.DFlashDrafter`` (the engine seam), ``export`` (the
DFlash HF format SGLang / vLLM / z-lab read) and ``build`` (the registry entries).
"""

from draftlab.methods.dflash.build import build_draft, load_artifact, save_artifact
from draftlab.methods.dflash.config import DFlashConfig, default_gamma, default_mask_token_id, default_taps
from draftlab.methods.dflash.drafter import DFlashDrafter
from draftlab.methods.dflash.model import DFlashDraft, block_attention

__all__ = ["DFlashConfig", "DFlashDraft", "DFlashDrafter", "block_attention", "build_draft", "default_gamma",
           "default_mask_token_id", "default_taps", "load_artifact", "save_artifact"]
