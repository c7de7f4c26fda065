"""Draft-OPD's prompts: the conversation DataModule, each training batch repeated for a whole phase.

A batch's rows are rendered conversations; the module decodes each one's prefix up to its first trained
(assistant) token (``rollout.prompt_of``), so the shared data stage (chat templates, sources, splits) is
used unchanged and its responses are never trained on. ``repeat_batches`` is the module's
``refresh_every``: the first step of a phase rolls the batch out, the following steps replay it.
"""

from __future__ import annotations

from draftlab.data.datamodule import ConversationDataModule


class PromptDataModule(ConversationDataModule):
    """``ConversationDataModule`` with the pipeline's ``feature_dir`` argument (always None: rollouts make
    their own data)."""

    def __init__(self, samples, feature_dir=None, **kwargs) -> None:
        if feature_dir is not None:
            raise ValueError("method=draft_opd decodes its own rollouts: set method.features to null")
        super().__init__(samples, **kwargs)
