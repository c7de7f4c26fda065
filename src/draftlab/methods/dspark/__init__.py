"""DSpark (DeepSeek DeepSpec; vLLM ``Qwen3DSparkModel``): DFlash's parallel block pass, then a lightweight
sequential low-rank Markov head and a confidence head that sizes each round's block.

``config.DSparkConfig`` / ``model.DSparkDraft`` (a ``DFlashDraft`` plus ``markov_head`` and
``confidence_head``), ``module.DSparkModule`` (DFlash's loss plus the heads'), ``drafter.DSparkDrafter``
(the engine seam), ``export`` (the vLLM DSpark directory) and ``build`` (the registry entries).
"""

from draftlab.methods.dspark.build import build_draft, load_artifact, save_artifact
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.methods.dspark.drafter import DSparkDrafter
from draftlab.methods.dspark.model import DSparkDraft

__all__ = ["DSparkConfig", "DSparkDraft", "DSparkDrafter", "build_draft", "load_artifact", "save_artifact"]
