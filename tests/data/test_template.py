from __future__ import annotations

import pytest

from draftlab.data import (
    ChatTemplateError,
    Conversation,
    DataError,
    end_of_turn_token_id,
    render_conversation,
    render_conversations,
    render_prompt,
    require_chat_template,
)

TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
]

# Written for these tests in the shape of Llama-3's template: headers in special tokens, content trimmed,
# every turn closed by <|eot_id|> with no separator after it.
LLAMA3_LIKE_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def masked_segments(tok, sample):
    """Decoded runs of consecutive loss-masked tokens."""
    runs, current = [], []
    for tid, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            current.append(tid)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


def masked_tokens(tok, sample):
    return [tok.decode([t]) for t, m in zip(sample.input_ids, sample.loss_mask) if m]


def llama3_tokenizer(tok):
    tok.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    tok.chat_template = LLAMA3_LIKE_TEMPLATE
    return tok


def test_smollm2_golden_two_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    sample = render_conversation(tok, Conversation("c1", TWO_TURNS))
    assert sample.id == "c1" and not sample.truncated
    assert masked_tokens(tok, sample) == [
        "Hello",
        " there",
        "<|im_end|>",
        "Fine",
        ",",
        " thanks",
        ".",
        "<|im_end|>",
    ]
    assert masked_segments(tok, sample) == ["Hello there<|im_end|>", "Fine, thanks.<|im_end|>"]
    # The ids are exactly the tokenisation of the template's own render (default system prompt included).
    text = tok.apply_chat_template(TWO_TURNS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert sample.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert len(sample.loss_mask) == len(sample.input_ids)
    # Headers and the newline after <|im_end|> stay out of the loss.
    i = sample.input_ids.index(2, sample.loss_mask.index(1))
    assert (
        sample.loss_mask[i] == 1
        and tok.decode([sample.input_ids[i + 1]]) == "\n"
        and sample.loss_mask[i + 1] == 0
    )


def test_smollm2_content_whitespace_is_supervised(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Line one\nline two\n"}]
    sample = render_conversation(smollm2_tokenizer, msgs)
    assert masked_segments(smollm2_tokenizer, sample) == ["Line one\nline two\n<|im_end|>"]


def test_smollm2_explicit_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [{"role": "system", "content": "Be terse."}, *TWO_TURNS]
    sample = render_conversation(tok, msgs)
    text = tok.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi")
    assert "SmolLM" not in text
    assert masked_segments(tok, sample) == ["Hello there<|im_end|>", "Fine, thanks.<|im_end|>"]


def test_add_system_prompt_false_suppresses_template_default(smollm2_tokenizer):
    tok = smollm2_tokenizer
    sample = render_conversation(tok, TWO_TURNS, add_system_prompt=False)
    assert tok.decode(sample.input_ids).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi")
    assert masked_segments(tok, sample) == ["Hello there<|im_end|>", "Fine, thanks.<|im_end|>"]
    prompt = render_prompt(tok, TWO_TURNS[:1], add_system_prompt=False)
    assert (
        tok.decode(prompt)
        == "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_prompt_ends_with_assistant_header(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = render_prompt(tok, TWO_TURNS[:3])
    assert tok.decode(ids).endswith("<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n")
    # The prompt is a token-level prefix of the training sample, so drafts see the same context.
    assert render_conversation(tok, TWO_TURNS).input_ids[: len(ids)] == ids


def test_end_of_turn_token(smollm2_tokenizer, fresh_tokenizer):
    assert end_of_turn_token_id(smollm2_tokenizer) == 2  # <|im_end|>
    fresh_tokenizer.chat_template = None
    assert end_of_turn_token_id(fresh_tokenizer) == fresh_tokenizer.eos_token_id


def test_llama3_style_template(fresh_tokenizer):
    tok = llama3_tokenizer(fresh_tokenizer)
    msgs = [{"role": "system", "content": "You are helpful."}, *TWO_TURNS]
    msgs[2] = {"role": "assistant", "content": "  Hello there \n"}  # trimmed by the template
    sample = render_conversation(tok, msgs)
    text = tok.decode(sample.input_ids)
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
    )
    assert masked_segments(tok, sample) == ["Hello there<|eot_id|>", "Fine, thanks.<|eot_id|>"]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_token_id(tok) == eot
    assert sum(sample.loss_mask) == len(masked_tokens(tok, sample))
    assert tok.decode(render_prompt(tok, TWO_TURNS[:1])).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_template_without_special_end_of_turn(fresh_tokenizer):
    # Plain-text turns: the span ends at the reply's last non-space character.
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] | capitalize + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
    )
    sample = render_conversation(fresh_tokenizer, TWO_TURNS)
    # BPE merges the header's trailing space into the reply's first token (" Hello"); a token belongs to
    # the reply when its last character does, so it is supervised.
    assert masked_segments(fresh_tokenizer, sample) == [" Hello there", " Fine, thanks."]
    assert end_of_turn_token_id(fresh_tokenizer) == fresh_tokenizer.eos_token_id


def test_template_rewriting_content(fresh_tokenizer):
    # The reply cannot be found verbatim (upper-cased), so the span runs to the turn's last non-space text.
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | upper + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    sample = render_conversation(fresh_tokenizer, TWO_TURNS)
    assert masked_segments(fresh_tokenizer, sample) == ["HELLO THERE<|im_end|>", "FINE, THANKS.<|im_end|>"]
    assert end_of_turn_token_id(fresh_tokenizer) == 2


def test_missing_template(fresh_tokenizer):
    fresh_tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="smollm2-135m-instruct.*has no chat template"):
        require_chat_template(fresh_tokenizer)
    with pytest.raises(DataError, match="no chat template"):
        render_conversation(fresh_tokenizer, TWO_TURNS)


def test_non_prefix_stable_template(fresh_tokenizer):
    # Closes the document only when there is no generation prompt: a render of the first turns is then
    # not a prefix of the whole conversation's render.
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% else %}{{ '<|endoftext|>' }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        render_conversation(fresh_tokenizer, TWO_TURNS)


def test_template_raising_is_reported(fresh_tokenizer):
    fresh_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_conversation(fresh_tokenizer, TWO_TURNS)


def test_assistant_first_is_rejected(smollm2_tokenizer):
    with pytest.raises(DataError, match="normalize"):
        render_conversation(smollm2_tokenizer, TWO_TURNS[1:])


def test_truncation_and_drop(smollm2_tokenizer):
    tok = smollm2_tokenizer
    full = render_conversation(tok, TWO_TURNS)
    n = len(full.input_ids)
    cut = render_conversation(tok, TWO_TURNS, max_length=n - 3)
    assert (
        cut.truncated
        and cut.input_ids == full.input_ids[: n - 3]
        and cut.loss_mask == full.loss_mask[: n - 3]
    )
    assert render_conversation(tok, TWO_TURNS, max_length=n, truncation="drop") is not None
    assert render_conversation(tok, TWO_TURNS, max_length=n - 1, truncation="drop") is None
    with pytest.raises(ValueError):
        render_conversation(tok, TWO_TURNS, truncation="left")

    convs = [
        Conversation("short", TWO_TURNS[:2]),
        Conversation("long", TWO_TURNS),
        Conversation("unanswered", TWO_TURNS[:1]),
    ]
    short_len = len(render_conversation(tok, TWO_TURNS[:2]).input_ids)
    samples, report = render_conversations(tok, convs, max_length=short_len)
    assert [s.id for s in samples] == ["short", "long"]
    assert (report.input, report.kept, report.truncated, report.dropped_too_long, report.dropped_no_loss) == (
        3,
        2,
        1,
        0,
        1,
    )
    samples, report = render_conversations(tok, convs, max_length=short_len, truncation="drop")
    assert [s.id for s in samples] == ["short"]
    assert (report.kept, report.truncated, report.dropped_too_long, report.dropped_no_loss) == (1, 0, 1, 1)
    # Cut before the first reply: nothing left to learn from.
    samples, report = render_conversations(tok, convs[:1], max_length=10)
    assert samples == [] and report.dropped_no_loss == 1
    assert "kept 0/1" in str(report)


def test_real_sharegpt_masks(smollm2_tokenizer, shared_data):
    from draftlab.data import load_sharegpt, normalize

    tok = smollm2_tokenizer
    convs, _ = normalize(load_sharegpt(shared_data / "conversations" / "sharegpt_v3_first5000.jsonl")[:60])
    samples, report = render_conversations(tok, convs, max_length=2048)
    assert report.kept == len(samples) > 40
    by_id = {c.id: c for c in convs}
    for sample in samples:
        conv = by_id[sample.id]
        replies = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        segments = masked_segments(tok, sample)
        expected = [r + "<|im_end|>" for r in replies]
        if sample.truncated:
            assert segments[:-1] == expected[: len(segments) - 1]
            assert expected[len(segments) - 1].startswith(segments[-1])
        else:
            assert segments == expected
