"""Lightning DataModule over rendered conversations: deterministic split, length bucketing, right padding."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from draftlab.data.template import RenderedSample
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


def _id_fraction(key: str) -> float:
    """Map an id to a stable number in [0, 1) (Python's ``hash`` is salted per process)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:16], 16) / 2**64


class PadCollator:
    """Right-pad a list of samples to the longest one; a class (not a closure) so workers can pickle it."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[RenderedSample]) -> dict[str, torch.Tensor]:
        width = max(len(s.input_ids) for s in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, s in enumerate(batch):
            n = len(s.input_ids)
            input_ids[row, :n] = torch.tensor(s.input_ids, dtype=torch.long)
            attention_mask[row, :n] = 1
            loss_mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


class _EpochForwarder:
    # Lightning calls set_epoch on ``dataloader.sampler`` and ``batch_sampler.sampler``, never on the
    # batch sampler itself; exposing this as ``.sampler`` routes the epoch to it.
    def __init__(self, owner: LengthBucketBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar-length samples in a seeded, per-epoch order.

    Each epoch: shuffle all indices, cut them into chunks of ``chunk_batches * batch_size``, sort each
    chunk by length (longest first) and split it into batches, then shuffle the batch order. Sorting
    within chunks rather than globally keeps padding low while still mixing lengths across the epoch.
    With ``bucket_by_length=False`` batches are plain consecutive slices of the shuffled order; with
    ``shuffle=False`` nothing is shuffled (validation). The order depends only on ``seed`` and the epoch.
    ``repeat`` yields every batch that many times in a row (a method that works on one batch for several
    optimiser steps, such as on-policy rollouts refreshed every ``repeat`` steps); resume counts repeats.

    ``num_replicas``/``rank`` shard whole batches across data-parallel ranks (every rank gets the same
    number; the list is padded by repeating batches from the start). Under Lightning DDP, pass
    ``use_distributed_sampler=False`` to the Trainer so it does not try to replace this sampler.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        bucket_by_length: bool = True,
        chunk_batches: int = 50,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        repeat: int = 1,
    ) -> None:
        if batch_size < 1 or chunk_batches < 1 or repeat < 1:
            raise ValueError("batch_size, chunk_batches and repeat must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket_by_length = bucket_by_length
        self.chunk_batches = chunk_batches
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.repeat = repeat
        self.epoch = 0
        # (epoch, batches): skip that many batches the next time that epoch is iterated (mid-epoch resume).
        self.resume_at: tuple[int, int] | None = None
        self.sampler = _EpochForwarder(self)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields."""
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        n = len(self.lengths)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
        order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
        if self.bucket_by_length:
            chunk = self.chunk_batches * self.batch_size
            ordered = []
            for start in range(0, n, chunk):
                ordered += sorted(order[start : start + chunk], key=lambda i: -self.lengths[i])
            order = ordered
        batches = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle and batches:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        return batches

    def _rank_batches(self) -> list[list[int]]:
        batches = self._all_batches()
        if self.num_replicas == 1 or not batches:
            return batches
        per_rank = -(-len(batches) // self.num_replicas)
        padded = (batches * self.num_replicas)[: per_rank * self.num_replicas]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self.resume_at is not None and self.resume_at[0] == self.epoch:
            skip, self.resume_at = self.resume_at[1], None
        batches = self._rank_batches()
        if self.repeat > 1:
            batches = [b for b in batches for _ in range(self.repeat)]
        yield from batches[skip:]

    def __len__(self) -> int:
        n = (
            len(self.lengths) // self.batch_size
            if self.drop_last
            else -(-len(self.lengths) // self.batch_size)
        )
        return -(-n // self.num_replicas) * self.repeat


class _SampleDataset(Dataset):
    def __init__(self, samples: Sequence[RenderedSample]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> RenderedSample:
        return self.samples[index]


class ConversationDataModule(L.LightningDataModule):
    """Train/val loaders over :class:`RenderedSample` lists, yielding ``input_ids``/``attention_mask``/``loss_mask`` ``[B, T]``.

    ``samples`` may be a callable, evaluated once in :meth:`setup`, so rendering happens where the data
    is needed rather than when the config is instantiated. The split depends only on each sample's id
    (sha256), not on ``seed``: runs with different seeds evaluate on the same held-out conversations, and
    all samples sharing an id land on the same side. If ``val_fraction > 0`` puts no sample in
    validation, the one with the smallest hash is moved there so validation is never silently empty.
    """

    def __init__(
        self,
        samples: Sequence[RenderedSample] | Callable[[], Sequence[RenderedSample]],
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        bucket_by_length: bool = True,
        pad_token_id: int = 0,
        num_workers: int = 0,
        chunk_batches: int = 50,
        drop_last: bool = False,
        repeat_batches: int = 1,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self._source = samples
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.bucket_by_length = bucket_by_length
        self.pad_token_id = pad_token_id
        self.num_workers = num_workers
        self.chunk_batches = chunk_batches
        self.drop_last = drop_last
        self.repeat_batches = repeat_batches
        self.train_samples: list[RenderedSample] | None = None
        self.val_samples: list[RenderedSample] | None = None
        # Positions of the split samples in the full sample list (offline feature files are keyed by them).
        self.train_indices: list[int] = []
        self.val_indices: list[int] = []
        self._resume: dict | None = None
        self._train_sampler: LengthBucketBatchSampler | None = None

    def setup(self, stage: str | None = None) -> None:
        """Materialise the samples (once) and split them into train and validation."""
        if self.train_samples is not None:
            return
        samples = list(self._source() if callable(self._source) else self._source)
        # Empty ids would all hash alike; fall back to the position so they still spread over both splits.
        keys = [s.id or f"#{i}" for i, s in enumerate(samples)]
        fractions = [_id_fraction(k) for k in keys]
        is_val = [f < self.val_fraction for f in fractions]
        if self.val_fraction > 0 and not any(is_val) and len(set(keys)) > 1:
            first = keys[min(range(len(keys)), key=fractions.__getitem__)]
            is_val = [k == first for k in keys]
        self.train_indices = [i for i, v in enumerate(is_val) if not v]
        self.val_indices = [i for i, v in enumerate(is_val) if v]
        self.train_samples = [samples[i] for i in self.train_indices]
        self.val_samples = [samples[i] for i in self.val_indices]
        log.info("data split: %d train / %d val samples", len(self.train_samples), len(self.val_samples))

    # ---- mid-epoch resume: Lightning stores this in checkpoints and restores it before building loaders --

    def state_dict(self) -> dict:
        """Data position: the epoch and how many of its batches the optimiser has already consumed."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": int(trainer.current_epoch), "batches_done": int(progress.processed)}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state) if state else None
        # Lightning may have built the train loader already (to count steps); tell its sampler too.
        if self._resume and self._train_sampler is not None:
            self._train_sampler.resume_at = (self._resume["epoch"], self._resume["batches_done"])

    def _dataset(self, samples: list[RenderedSample], indices: list[int]) -> Dataset:
        return _SampleDataset(samples)

    def _collator(self) -> Callable:
        return PadCollator(self.pad_token_id)

    def _loader(self, samples: list[RenderedSample], *, train: bool) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        replicas = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        sampler = LengthBucketBatchSampler(
            [len(s.input_ids) for s in samples],
            self.batch_size,
            seed=self.seed,
            shuffle=train,
            bucket_by_length=self.bucket_by_length,
            chunk_batches=self.chunk_batches,
            drop_last=self.drop_last and train,
            num_replicas=replicas,
            rank=rank,
            repeat=self.repeat_batches if train else 1,
        )
        if trainer is not None:
            sampler.set_epoch(trainer.current_epoch)
        if train:
            self._train_sampler = sampler
            if self._resume:
                # Without this, a resumed epoch would replay its first batches from the start of the order.
                sampler.resume_at = (self._resume["epoch"], self._resume["batches_done"])
                log.info("resuming epoch %d after %d batches", *sampler.resume_at)
        indices = self.train_indices if train else self.val_indices
        return DataLoader(
            self._dataset(samples, indices),
            batch_sampler=sampler,
            collate_fn=self._collator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled (and, if enabled, length-bucketed) batches; the order changes with each epoch."""
        self.setup()
        assert self.train_samples is not None
        return self._loader(self.train_samples, train=True)

    def val_dataloader(self) -> DataLoader | list:
        """Unshuffled batches over the held-out samples; an empty list when there are none."""
        self.setup()
        assert self.val_samples is not None
        if not self.val_samples:
            return []
        return self._loader(self.val_samples, train=False)
