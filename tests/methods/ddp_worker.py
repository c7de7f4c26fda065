"""Trains the EAGLE-3 module for a few steps under ``conf/trainer/<name>.yaml`` on argv[4] processes (default 2).

Run as a script (Lightning's DDP launcher re-executes it for rank 1). Rank 0 writes, to argv[2], each
rank's checksum of the draft weights gathered after training, the checksum before training and the device the
target trained on. The target is built on the CPU: on a GPU, ``TargetPlacement`` moves it (as in draftlab-train).
"""

from __future__ import annotations

import json
import os
import random
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from draftlab.data.template import RenderedSample
from draftlab.data.vocab import build_vocab_mapping, token_frequencies
from draftlab.methods.eagle3 import Eagle3Draft
from draftlab.methods.eagle3.data import Eagle3DataModule
from draftlab.methods.eagle3.module import Eagle3Module
from draftlab.targets import load_target
from draftlab.training.placement import TargetPlacement

CONF = Path(__file__).resolve().parents[2] / "conf"


def checksum(module) -> torch.Tensor:
    # Weighted sums catch permutations as well as value changes.
    parts = [p.detach().double().flatten() for p in module.draft.parameters() if p.requires_grad]
    flat = torch.cat(parts)
    return torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)).sum()])


class Gather(L.Callback):
    def __init__(self, out: Path, before: torch.Tensor):
        self.out, self.before = out, before

    def on_train_end(self, trainer, pl_module):
        sums = trainer.strategy.all_gather(checksum(pl_module))  # [world, 2]
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"world_size": trainer.world_size, "ranks": sums.reshape(-1, 2).tolist(),
                                            "before": self.before.tolist(), "steps": trainer.global_step,
                                            "target_device": str(pl_module.target.device)}))


def main(trainer_name: str, out: str, accelerator: str = "cpu", devices: str = "2") -> None:
    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"trainer={trainer_name}", "paths.output_dir=.",
                                                     "paths.log_dir=."])
    tokenizer = os.environ.get("DRAFTLAB_TEST_TOKENIZER")  # a local copy, for a GPU node without network
    target = load_target("tiny_random", **({"tokenizer": tokenizer} if tokenizer else {}))
    rng = random.Random(0)
    samples = [RenderedSample([rng.randint(100, 300) for _ in range(16)], [0] * 4 + [1] * 12, f"s{i}") for i in range(16)]
    torch.manual_seed(0)
    mapping = build_vocab_mapping(token_frequencies(samples, target.geometry.vocab_size), 256)
    draft = Eagle3Draft.from_target(target, vocab_mapping=mapping, intermediate_size=96)
    module = Eagle3Module(draft, target, ttt_length=2, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    # Each rank draws different batches, so equal weights afterwards show gradients were all-reduced.
    dm = Eagle3DataModule(samples, batch_size=2, val_fraction=0.0)
    trainer = instantiate(cfg.trainer, accelerator=accelerator, devices=int(devices), max_epochs=1, max_steps=3,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          use_distributed_sampler=False, default_root_dir=str(Path(out).parent),
                          callbacks=[Gather(Path(out), checksum(module)), TargetPlacement()])
    trainer.fit(module, datamodule=dm)


if __name__ == "__main__":
    main(*sys.argv[1:5])
