from __future__ import annotations

import logging

import pytest
import torch

from draftlab.data import (
    DataError,
    RenderedSample,
    build_vocab_mapping,
    load_or_build_vocab_mapping,
    token_frequencies,
    vocab_mapping_cache_key,
    vocab_mapping_path,
)


def sample(ids, mask, id_="s"):
    return RenderedSample(input_ids=ids, loss_mask=mask, id=id_, truncated=False)


def test_token_frequencies_counts_masked_only():
    samples = [sample([1, 2, 3, 3], [0, 1, 1, 1]), sample([3, 5, 2], [1, 0, 1])]
    freq = token_frequencies(samples, vocab_size=6)
    assert freq.dtype == torch.long and freq.tolist() == [0, 0, 2, 3, 0, 0]
    with pytest.raises(DataError, match="vocab_size"):
        token_frequencies([sample([9], [1])], vocab_size=6)


def test_build_mapping_hand_computed(caplog):
    freq = torch.tensor([0, 5, 0, 3, 7, 1, 0, 2])
    logger = logging.getLogger("draftlab")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="draftlab"):
            m = build_vocab_mapping(freq, draft_vocab_size=3)
    finally:
        logger.removeHandler(caplog.handler)
    # Top 3 by count: 4 (7), 1 (5), 3 (3) -> sorted S = [1, 3, 4]; d2t = S - arange = [1, 2, 2].
    assert m.d2t.dtype == torch.long and m.d2t.tolist() == [1, 2, 2]
    assert m.t2d.dtype == torch.bool and m.t2d.tolist() == [
        False,
        True,
        False,
        True,
        True,
        False,
        False,
        False,
    ]
    assert m.coverage == pytest.approx(15 / 18)
    assert (m.d2t + torch.arange(3)).tolist() == [1, 3, 4] == m.target_ids().tolist()
    assert m.draft_to_target(torch.tensor([[2, 0], [1, 1]])).tolist() == [[4, 1], [3, 3]]
    assert m.target_ids().tolist() == m.t2d.nonzero().flatten().tolist()
    assert "top 3 token frequency ratio: 83.33%" in caplog.text


def test_ties_go_to_lower_ids():
    m = build_vocab_mapping(torch.tensor([2, 0, 2, 2, 1]), draft_vocab_size=2)
    assert m.target_ids().tolist() == [0, 2] and m.d2t.tolist() == [0, 1]


def test_padding_with_lowest_unused_ids():
    # Only ids 2 and 4 occur; V_d = 4 pads with the lowest unused ids 0 and 1.
    m = build_vocab_mapping(torch.tensor([0, 0, 4, 0, 1, 0]), draft_vocab_size=4)
    assert m.target_ids().tolist() == [0, 1, 2, 4]
    assert m.d2t.tolist() == [0, 0, 0, 1]
    assert m.t2d.tolist() == [True, True, True, False, True, False]
    assert m.coverage == 1.0


def test_full_vocab_is_identity():
    m = build_vocab_mapping(torch.tensor([3, 0, 1]), draft_vocab_size=3)
    assert m.d2t.tolist() == [0, 0, 0] and bool(m.t2d.all())


def test_bad_sizes():
    with pytest.raises(ValueError):
        build_vocab_mapping(torch.tensor([1, 2]), draft_vocab_size=3)
    with pytest.raises(ValueError):
        build_vocab_mapping(torch.tensor([1, 2]), draft_vocab_size=0)
    with pytest.raises(DataError, match="no loss-masked tokens"):
        build_vocab_mapping(torch.zeros(4, dtype=torch.long), draft_vocab_size=2)


def test_cache_key():
    args = ("data-sha", "{{ template }}", "smollm2", 2048, 32000)
    key = vocab_mapping_cache_key(*args)
    assert len(key) == 64 and int(key, 16) >= 0 and key == vocab_mapping_cache_key(*args)
    for i, changed in enumerate(("other", "{{ other }}", "llama", 4096, 16000)):
        assert vocab_mapping_cache_key(*args[:i], changed, *args[i + 1 :]) != key


def test_load_or_build_caches(tmp_path):
    calls = []

    def samples_fn():
        calls.append(1)
        return [sample([1, 2, 2, 5], [1, 1, 1, 1]), sample([5, 5], [1, 1])]

    key = vocab_mapping_cache_key("d", "t", "tok", 16, 2)
    first = load_or_build_vocab_mapping(
        samples_fn, cache_dir=tmp_path, key=key, vocab_size=8, draft_vocab_size=2
    )
    path = vocab_mapping_path(tmp_path, key)
    assert path == tmp_path / "vocab_mapping" / f"{key}.pt" and path.exists() and calls == [1]
    assert first.target_ids().tolist() == [2, 5] and first.coverage == pytest.approx(5 / 6)
    blob = torch.load(path, weights_only=True)
    assert blob["d2t"].tolist() == [2, 4] and blob["t2d"].shape == (8,)

    def must_not_run():
        raise AssertionError("cache hit expected")

    again = load_or_build_vocab_mapping(
        must_not_run, cache_dir=tmp_path, key=key, vocab_size=8, draft_vocab_size=2
    )
    assert (
        torch.equal(again.d2t, first.d2t)
        and torch.equal(again.t2d, first.t2d)
        and again.coverage == first.coverage
    )
    # A cached file of the wrong shape is rebuilt rather than trusted.
    rebuilt = load_or_build_vocab_mapping(
        samples_fn, cache_dir=tmp_path, key=key, vocab_size=8, draft_vocab_size=3
    )
    assert rebuilt.target_ids().tolist() == [1, 2, 5] and calls == [1, 1]


def test_mapping_from_rendered_data(smollm2_tokenizer):
    from draftlab.data import render_conversation

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    s = render_conversation(smollm2_tokenizer, msgs)
    freq = token_frequencies([s], vocab_size=len(smollm2_tokenizer))
    assert int(freq.sum()) == 3 and int(freq[2]) == 1  # "Hello", " there", <|im_end|>
    m = build_vocab_mapping(freq, draft_vocab_size=8)
    assert 2 in m.target_ids().tolist() and m.coverage == 1.0
