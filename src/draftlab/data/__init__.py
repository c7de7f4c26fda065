"""Data layer: conversations -> chat template + loss mask -> vocab mapping / DataModule; benchmark prompts.

Names are imported lazily: the DataModule pulls in Lightning (~10 s to import on a small CPU machine),
which loaders, templates and benchmark readers have no need for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "DataError": "errors",
    # conversations
    "ROLE_ALIASES": "conversations",
    "Conversation": "conversations",
    "NormalizeReport": "conversations",
    "load_conversations": "conversations",
    "load_gsm8k": "conversations",
    "load_hf_dataset": "conversations",
    "load_role_content_jsonl": "conversations",
    "load_sharegpt": "conversations",
    "normalize": "conversations",
    # template
    "ChatTemplateError": "template",
    "RenderReport": "template",
    "RenderedSample": "template",
    "end_of_turn_token_id": "template",
    "render_conversation": "template",
    "render_conversations": "template",
    "render_prompt": "template",
    "require_chat_template": "template",
    # vocab
    "VocabMapping": "vocab",
    "build_vocab_mapping": "vocab",
    "load_or_build_vocab_mapping": "vocab",
    "token_frequencies": "vocab",
    "vocab_mapping_cache_key": "vocab",
    "vocab_mapping_path": "vocab",
    # benchmarks
    "CONFU_COLUMNS": "benchmarks",
    "HUMANEVAL_INSTRUCTION": "benchmarks",
    "SPECBENCH_CATEGORY_TO_COLUMN": "benchmarks",
    "Question": "benchmarks",
    "category_column": "benchmarks",
    "load_humaneval": "benchmarks",
    "load_question_jsonl": "benchmarks",
    "select_questions": "benchmarks",
    # datamodule
    "ConversationDataModule": "datamodule",
    "LengthBucketBatchSampler": "datamodule",
    "PadCollator": "datamodule",
}

__all__ = [
    "CONFU_COLUMNS",
    "ChatTemplateError",
    "Conversation",
    "ConversationDataModule",
    "DataError",
    "HUMANEVAL_INSTRUCTION",
    "LengthBucketBatchSampler",
    "NormalizeReport",
    "PadCollator",
    "Question",
    "ROLE_ALIASES",
    "RenderReport",
    "RenderedSample",
    "SPECBENCH_CATEGORY_TO_COLUMN",
    "VocabMapping",
    "build_vocab_mapping",
    "category_column",
    "end_of_turn_token_id",
    "load_conversations",
    "load_gsm8k",
    "load_hf_dataset",
    "load_humaneval",
    "load_or_build_vocab_mapping",
    "load_question_jsonl",
    "load_role_content_jsonl",
    "load_sharegpt",
    "normalize",
    "render_conversation",
    "render_conversations",
    "render_prompt",
    "require_chat_template",
    "select_questions",
    "token_frequencies",
    "vocab_mapping_cache_key",
    "vocab_mapping_path",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from draftlab.data.benchmarks import (
        CONFU_COLUMNS,
        HUMANEVAL_INSTRUCTION,
        SPECBENCH_CATEGORY_TO_COLUMN,
        Question,
        category_column,
        load_humaneval,
        load_question_jsonl,
        select_questions,
    )
    from draftlab.data.conversations import (
        ROLE_ALIASES,
        Conversation,
        NormalizeReport,
        load_conversations,
        load_gsm8k,
        load_hf_dataset,
        load_role_content_jsonl,
        load_sharegpt,
        normalize,
    )
    from draftlab.data.datamodule import ConversationDataModule, LengthBucketBatchSampler, PadCollator
    from draftlab.data.errors import DataError
    from draftlab.data.template import (
        ChatTemplateError,
        RenderedSample,
        RenderReport,
        end_of_turn_token_id,
        render_conversation,
        render_conversations,
        render_prompt,
        require_chat_template,
    )
    from draftlab.data.vocab import (
        VocabMapping,
        build_vocab_mapping,
        load_or_build_vocab_mapping,
        token_frequencies,
        vocab_mapping_cache_key,
        vocab_mapping_path,
    )
