"""DFlash2: DFlash's block draft with dynamic block convolutions around every sublayer and a candidate
selector that re-ranks each slot's unary top-K given the previous token.

``model`` (``DFlash2Draft``: ``BlockConv``, ``CandidateSelector``), ``selector_loss`` and ``module``
(``DFlash2Module``: DFlash's loss plus the selector's), ``drafter`` (``DFlash2Drafter``: the selector's walk),
``export`` (vLLM's ``DFlash2DraftModel`` format) and ``build`` (the registry entries).
"""

from draftlab.methods.dflash2.build import build_draft, load_artifact, save_artifact
from draftlab.methods.dflash2.config import DFlash2Config
from draftlab.methods.dflash2.drafter import DFlash2Drafter
from draftlab.methods.dflash2.model import DFlash2Draft

__all__ = ["DFlash2Config", "DFlash2Draft", "DFlash2Drafter", "build_draft", "load_artifact", "save_artifact"]
