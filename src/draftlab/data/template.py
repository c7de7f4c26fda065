"""Chat-template rendering and assistant loss masks, derived from the tokenizer's own Jinja template.

SpecForge keeps a registry of hand-written templates (assistant header, end-of-turn token) and finds
assistant spans with a regex; EAGLE hard-codes Llama-3 separators and offsets. Both break when the
served template drifts from the registry entry. Here the span of assistant turn ``i`` is found by
rendering the conversation progressively with the tokenizer's template:

* ``render(messages[:i], add_generation_prompt=True)`` ends exactly where the assistant starts writing,
  i.e. after the header the serving engine would add;
* ``render(messages[:i+1])`` ends after that turn (content, end-of-turn token, separator).

The loss span is the content plus the first special token after it (the end-of-turn token, which the
drafter must learn to predict so generation stops); the header and any separator after the end-of-turn
token are excluded, since the target never generates them as part of a reply. This works for any
template whose renders of a conversation's prefixes are prefixes of its full render; templates that are
not (e.g. ones that rewrite earlier turns depending on later ones) are rejected with a clear error
rather than producing a silently wrong mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from draftlab.data.conversations import Conversation
from draftlab.data.errors import DataError

Truncation = Literal["truncate", "drop"]
_PROBE = "draftlab probe reply"


class ChatTemplateError(DataError):
    """The tokenizer has no chat template, or its template cannot be used to locate assistant turns."""


@dataclass
class RenderedSample:
    """One tokenised conversation: ids, a 0/1 loss mask over them, the source id, and whether it was cut."""

    input_ids: list[int]
    loss_mask: list[int]
    id: str
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


def _tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def require_chat_template(tokenizer: Any) -> Any:
    """Return ``tokenizer.chat_template``, raising :class:`ChatTemplateError` when it is missing."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            f"tokenizer '{_tokenizer_name(tokenizer)}' has no chat template; loss masks are derived from the "
            "template the target is served with, so use the instruct/chat checkpoint's tokenizer or set "
            "tokenizer.chat_template to a Jinja template"
        )
    return template


def _render(tokenizer: Any, messages: Sequence[dict], *, add_generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except DataError:
        raise
    except Exception as exc:  # Jinja raise_exception() and template bugs surface as arbitrary types
        raise ChatTemplateError(
            f"chat template of '{_tokenizer_name(tokenizer)}' failed to render {len(messages)} messages: {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(
            f"apply_chat_template of '{_tokenizer_name(tokenizer)}' returned {type(text).__name__}"
        )
    return text


def _special_token_strings(tokenizer: Any) -> list[str]:
    specials = {t for t in getattr(tokenizer, "all_special_tokens", []) if t}
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False) and added.content:
            specials.add(added.content)
    # Longest first so that, at one position, "<|eot_id|>" wins over a shorter special it starts with.
    return sorted(specials, key=len, reverse=True)


def _turn_end(turn: str, content: str, specials: Sequence[str]) -> tuple[int, str | None]:
    """Offset in ``turn`` just past the end-of-turn token after ``content``, and that token.

    Templates may trim the content, so it is searched for stripped. Without a special token after it,
    or when the template rewrote the content beyond recognition, the span ends at the turn's last
    non-whitespace character, which for every common template is the end-of-turn token itself.
    """
    core = content.strip()
    pos = turn.find(core) if core else -1
    if pos < 0 and core:
        end = len(turn.rstrip())
        return end, next((t for t in specials if turn.startswith(t, end - len(t))), None)
    after = pos + len(core) if pos >= 0 else 0
    best: tuple[int, str] | None = None
    for tok in specials:
        at = turn.find(tok, after)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tok)
    if best is None:
        return len(turn.rstrip()), None
    return best[0] + len(best[1]), best[1]


def _with_system_choice(messages: Sequence[dict], add_system_prompt: bool) -> list[dict]:
    msgs = [dict(m) for m in messages]
    if not add_system_prompt and not any(m["role"] == "system" for m in msgs):
        # The only template-agnostic way to stop a template injecting its default system prompt is an
        # explicit empty one, which is also what a serving client must send to get that behaviour.
        msgs.insert(0, {"role": "system", "content": ""})
    return msgs


def _assistant_spans(tokenizer: Any, messages: Sequence[dict], full: str) -> list[tuple[int, int]]:
    specials = _special_token_strings(tokenizer)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("conversation starts with an assistant turn; run normalize() to re-anchor it")
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        for what, count, part in (("generation-prompt render", i, prefix), ("render", i + 1, upto)):
            if not full.startswith(part):
                raise ChatTemplateError(
                    f"chat template of '{_tokenizer_name(tokenizer)}' is not prefix-stable: the {what} of the first "
                    f"{count} messages is not a prefix of the whole conversation's render, "
                    "so assistant spans cannot be located (first difference at character "
                    f"{_first_difference(full, part)})"
                )
        if len(upto) < len(prefix):
            raise ChatTemplateError(
                f"chat template of '{_tokenizer_name(tokenizer)}' renders assistant turn {i} shorter than its "
                "generation prompt; cannot locate the reply"
            )
        stop, _ = _turn_end(upto[len(prefix) :], msg["content"], specials)
        spans.append((len(prefix), len(prefix) + stop))
    return spans


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    # A token belongs to a span when its last character does: a token that straddles the header/content
    # boundary (a merged leading space or newline) is then supervised, being mostly reply text.
    mask = []
    k = 0
    for start, end in offsets:
        last = max(start, end - 1)
        while k < len(spans) and spans[k][1] <= last:
            k += 1
        mask.append(int(k < len(spans) and spans[k][0] <= last < spans[k][1]))
    return mask


def render_conversation(
    tokenizer: Any,
    messages: Conversation | Sequence[dict],
    *,
    max_length: int | None = None,
    truncation: Truncation = "truncate",
    add_system_prompt: bool = True,
    sample_id: str | None = None,
) -> RenderedSample | None:
    """Tokenise a conversation with the tokenizer's chat template and mask its assistant replies.

    ``loss_mask`` is 1 on each assistant turn's content and its end-of-turn token (``<|im_end|>``,
    ``<|eot_id|>``), 0 on headers, other roles and separators. With ``max_length``, longer samples are
    cut (``truncation="truncate"``, ``truncated=True``) or skipped (``"drop"``, returns ``None``).

    ``add_system_prompt=False`` gives a conversation without a system turn an explicit empty system
    message, which stops templates like SmolLM2's or Qwen2.5's from injecting their default prompt (it
    renders as an empty system block; templates that always add one, like Llama-3.1's date header,
    still do). Pass a :class:`Conversation` to carry its id, or ``sample_id``.
    """
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    require_chat_template(tokenizer)
    if isinstance(messages, Conversation):
        sample_id = messages.id if sample_id is None else sample_id
        messages = messages.messages
    msgs = _with_system_choice(messages, add_system_prompt)

    full = _render(tokenizer, msgs, add_generation_prompt=False)
    spans = _assistant_spans(tokenizer, msgs, full)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(enc["input_ids"])
    loss_mask = _mask_from_offsets(enc["offset_mapping"], spans)

    truncated = False
    if max_length is not None and len(input_ids) > max_length:
        if truncation == "drop":
            return None
        input_ids, loss_mask, truncated = input_ids[:max_length], loss_mask[:max_length], True
    return RenderedSample(input_ids=input_ids, loss_mask=loss_mask, id=sample_id or "", truncated=truncated)


@dataclass
class RenderReport:
    """Counts from :func:`render_conversations`; ``input == kept + dropped_too_long + dropped_no_loss``."""

    input: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_loss: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def __str__(self) -> str:
        share = self.loss_tokens / self.tokens if self.tokens else 0.0
        return (
            f"render: kept {self.kept}/{self.input} (truncated {self.truncated}, dropped too long "
            f"{self.dropped_too_long}, dropped without loss tokens {self.dropped_no_loss}); "
            f"{self.tokens} tokens, {share:.1%} in the loss"
        )


def render_conversations(
    tokenizer: Any,
    convs: Iterable[Conversation],
    *,
    max_length: int | None = None,
    truncation: Truncation = "truncate",
    add_system_prompt: bool = True,
    min_loss_tokens: int = 1,
) -> tuple[list[RenderedSample], RenderReport]:
    """Render many conversations with :func:`render_conversation`, keeping those with enough loss tokens.

    A sample with fewer than ``min_loss_tokens`` masked tokens (no assistant turn, or every reply cut
    by truncation) is dropped: it would cost a forward pass and teach nothing.
    """
    report = RenderReport()
    samples = []
    for conv in convs:
        report.input += 1
        sample = render_conversation(
            tokenizer, conv, max_length=max_length, truncation=truncation, add_system_prompt=add_system_prompt
        )
        if sample is None:
            report.dropped_too_long += 1
            continue
        if sum(sample.loss_mask) < min_loss_tokens:
            report.dropped_no_loss += 1
            continue
        report.kept += 1
        report.truncated += sample.truncated
        report.tokens += len(sample.input_ids)
        report.loss_tokens += sum(sample.loss_mask)
        samples.append(sample)
    return samples, report


def render_prompt(tokenizer: Any, messages: Sequence[dict], *, add_system_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` followed by the assistant generation prompt, ready for generation."""
    require_chat_template(tokenizer)
    text = _render(tokenizer, _with_system_choice(messages, add_system_prompt), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_token_id(tokenizer: Any) -> int:
    """Id of the token that closes an assistant turn in the chat template (``<|im_end|>``, ``<|eot_id|>``).

    Found by rendering a probe reply and taking the first special token after it; falls back to the
    EOS token when the tokenizer has no template or the template closes turns without a special token.
    """
    eot: str | None = None
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        prefix = _render(tokenizer, msgs[:1], add_generation_prompt=True)
        upto = _render(tokenizer, msgs, add_generation_prompt=False)
        if upto.startswith(prefix):
            _, eot = _turn_end(upto[len(prefix) :], _PROBE, _special_token_strings(tokenizer))
    if eot is not None:
        return int(tokenizer.convert_tokens_to_ids(eot))
    if tokenizer.eos_token_id is None:
        raise ChatTemplateError(
            f"tokenizer '{_tokenizer_name(tokenizer)}' has neither a templated end-of-turn token nor an EOS token"
        )
    return int(tokenizer.eos_token_id)
