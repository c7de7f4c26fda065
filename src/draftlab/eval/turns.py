"""Answer a benchmark question turn by turn, as Spec-Bench and MT-bench do.

The second turn is conditioned on the model's *own* first answer (not a reference answer), so a
speculative method and AR see exactly the conversation each of them produced.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.data.benchmarks import Question
from draftlab.data.template import render_prompt
from draftlab.decoding.engine import (
    DecodeStats,
    GenerationConfig,
    autoregressive_generate,
    speculative_generate,
)


@dataclass
class TurnAnswer:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    stats: DecodeStats


def answer_question(target, question: Question, *, drafter=None, cfg: GenerationConfig | None = None
                    ) -> list[TurnAnswer]:
    """All turns of ``question``; ``drafter=None`` is AR through the same cache and sampling."""
    tok = target.tokenizer
    messages: list[dict] = []
    answers = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        prompt = render_prompt(tok, messages)
        if drafter is None:
            tokens, stats = autoregressive_generate(target, prompt, cfg)
        else:
            tokens, stats = speculative_generate(target, prompt, drafter, cfg)
        text = tok.decode(tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        answers.append(TurnAnswer(prompt, tokens, text, stats))
    return answers
