from __future__ import annotations

import pickle

import pytest
import torch

from draftlab.data import ConversationDataModule, LengthBucketBatchSampler, PadCollator, RenderedSample


def make_samples(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [
        RenderedSample(
            input_ids=[10 + i] * L,
            loss_mask=[0] * (L // 2) + [1] * (L - L // 2),
            id=f"conv-{i}",
            truncated=False,
        )
        for i, L in enumerate(lengths)
    ]


def test_collate_pads_right():
    batch = [
        RenderedSample([5, 6, 7], [0, 1, 1], "a", False),
        RenderedSample([8], [1], "b", False),
    ]
    out = PadCollator(pad_token_id=0)(batch)
    assert set(out) == {"input_ids", "attention_mask", "loss_mask"}
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in out.values())
    assert pickle.loads(pickle.dumps(PadCollator(3))).pad_token_id == 3  # workers must pickle it


def test_sampler_is_deterministic_and_covers_everything():
    lengths = [len(s) for s in make_samples(203)]
    a = LengthBucketBatchSampler(lengths, 8, seed=1, chunk_batches=5)
    b = LengthBucketBatchSampler(lengths, 8, seed=1, chunk_batches=5)
    first = list(a)
    assert first == list(b) == list(a)  # same seed and epoch -> same order, every time
    assert sorted(i for batch in first for i in batch) == list(range(203))
    assert len(first) == len(a) == 26
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(LengthBucketBatchSampler(lengths, 8, seed=2, chunk_batches=5)) != first


def test_bucketing_reduces_padding():
    lengths = [len(s) for s in make_samples(400)]

    def padding(sampler):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in sampler)

    bucketed = LengthBucketBatchSampler(lengths, 8, seed=0, chunk_batches=50)
    plain = LengthBucketBatchSampler(lengths, 8, seed=0, bucket_by_length=False)
    assert padding(bucketed) < padding(plain) / 3
    for batch in bucketed:  # each batch was cut from a length-sorted chunk
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)


def test_sampler_drop_last_no_shuffle_and_replicas():
    lengths = list(range(1, 22))  # 21 samples
    assert len(LengthBucketBatchSampler(lengths, 4, drop_last=True)) == 5
    assert all(len(b) == 4 for b in LengthBucketBatchSampler(lengths, 4, drop_last=True))
    ordered = list(LengthBucketBatchSampler(lengths, 4, shuffle=False, bucket_by_length=False))
    assert ordered[0] == [0, 1, 2, 3] and ordered[-1] == [20]
    shards = [list(LengthBucketBatchSampler(lengths, 4, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(LengthBucketBatchSampler(lengths, 4, num_replicas=2)) == 3
    covered = {i for shard in shards for b in shard for i in b}
    assert covered == set(range(21))


def test_lightning_routes_epoch_to_sampler():
    from lightning.fabric.utilities.data import _set_sampler_epoch

    dm = ConversationDataModule(make_samples(50), batch_size=4, val_fraction=0.0)
    loader = dm.train_dataloader()
    epoch0 = [b["input_ids"][:, 0].tolist() for b in loader]
    _set_sampler_epoch(loader, 3)  # what Lightning's fit loop calls each epoch
    assert loader.batch_sampler.epoch == 3
    assert [b["input_ids"][:, 0].tolist() for b in loader] != epoch0


def test_datamodule_split_and_batches():
    samples = make_samples(300)
    calls = []

    def produce():
        calls.append(1)
        return samples

    dm = ConversationDataModule(produce, batch_size=16, val_fraction=0.1, seed=0, pad_token_id=2)
    dm.setup("fit")
    dm.setup("validate")
    assert calls == [1]
    train_ids = {s.id for s in dm.train_samples}
    val_ids = {s.id for s in dm.val_samples}
    assert not train_ids & val_ids and len(train_ids) + len(val_ids) == 300
    assert 10 <= len(val_ids) <= 55
    # The split follows the ids only: another seed or another order keeps the same validation set.
    other = ConversationDataModule(list(reversed(samples)), batch_size=16, val_fraction=0.1, seed=7)
    other.setup()
    assert {s.id for s in other.val_samples} == val_ids

    batches = list(dm.train_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == len(train_ids)
    for b in batches:
        B, T = b["input_ids"].shape
        assert b["attention_mask"].shape == b["loss_mask"].shape == (B, T)
        assert int(b["attention_mask"].sum(1).max()) == T
        assert bool((b["input_ids"][b["attention_mask"] == 0] == 2).all())
        assert bool((b["loss_mask"] <= b["attention_mask"]).all())
    val = list(dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val) == len(val_ids)
    assert [b["input_ids"].tolist() for b in dm.val_dataloader()] == [b["input_ids"].tolist() for b in val]


def test_datamodule_small_and_empty_validation():
    tiny = make_samples(3)
    dm = ConversationDataModule(tiny, batch_size=2, val_fraction=0.01)
    dm.setup()
    assert len(dm.val_samples) == 1 and len(dm.train_samples) == 2  # never silently empty
    dm = ConversationDataModule(tiny, batch_size=2, val_fraction=0.0)
    assert dm.val_dataloader() == [] and len(dm.train_samples) == 3
    with pytest.raises(ValueError):
        ConversationDataModule(tiny, val_fraction=1.0)
