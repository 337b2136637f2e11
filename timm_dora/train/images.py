"""The images of a training run (paper App. E.1, App. C): the rollout split, streamed or held, and
the fixed sets the run measures itself on (the feedback checks' QC shards, the dev split).

- Opening a split reads its file list only (:func:`~timm_dora.data.open_split`); the labels are
  checked against the model's classes and the splits for overlap before any GPU work
  (:meth:`TrainingImages.check`: one ``stat`` per file, no read of a large split).
- The rollout images of an update are made by :class:`~timm_dora.train.pool.RolloutStream` from
  the files, in worker processes, while the previous update runs (``stream``), or, for a small
  split without augmentation, decoded once and held on the device (``held``, each image is
  used hundreds of times there). Both give the same images in the same order: ``uint8`` of the
  eval preprocessing, normalised on the device (:class:`~timm_dora.data.InputNormalize`).
- The checks and dev images are decoded once and held as ``uint8`` on the device (150 KB per
  224-px image: the paper's 16,384 + 10,240 take 4.0 GB); under ``torchrun`` each process holds
  and evaluates every ``world``-th image of each shard and of dev, and the counts are summed.
- An unreadable file never ends a run: it is left out (a fixed set) or replaced by the next
  readable image of the split (a rollout), with one warning naming it, and counted
  (``skipped_images`` in ``metrics.jsonl``).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

from .. import data as D
from . import pool as P

__all__ = ["ROLLOUT_DATA", "TrainingImages"]

ROLLOUT_DATA = ("auto", "held", "stream")  # --rollout-data: auto holds a small split without augmentation
# augmented pools: each worker keeps the decoded images it read, while pool size x workers is at most
# this (700 images x 14 workers: about 2 GB of 256-px images; a 10,000-image pool is read anew)
DECODED_CACHE_MAX = 20_000


class TrainingImages:
    """The splits of a run (file lists), then (:meth:`load`) the images it reads.

    Attributes after :meth:`load`: ``checks`` (this process's share of the feedback images, held),
    ``check_shards`` (its rows of each QC shard), ``dev`` (its share of dev, held), ``local_sizes``
    (the sizes of those shares: the trainer sums them over the processes), ``rollout_mode``
    (``held`` or ``stream``) and ``skipped`` (the unreadable files this process met)."""

    def __init__(self, cfg, model: torch.nn.Module):
        self.model, self.augment = model, P.augment_level(cfg.augment)
        self.rollout_set = D.open_split(cfg.data, cfg.rollout_split, P.train_transform(model, self.augment))
        self.qc_set = D.open_split(cfg.qc_data or cfg.data, cfg.qc_split)
        self.dev_set = D.open_split(cfg.dev_data or cfg.data, cfg.dev_split)
        self.splits = {"rollout": self.rollout_set, "qc": self.qc_set, "dev": self.dev_set}
        self.pool = self.rollout_set
        if cfg.rollout_with_checks:  # (ours) the rollouts draw from the qc and dev images too
            self.pool = D.joined([self.rollout_set, self.qc_set, self.dev_set], self.rollout_set.transform)
        self.stream: Optional[P.RolloutStream] = None
        self.skipped = 0  # unreadable files met by this process (held sets at load, then rollouts)
        self.warned: set = set()

    def check(self, num_classes: int) -> None:
        """Labels inside the model's classes and disjoint splits, or a one-line ``ValueError``."""
        D.check_labels(self.splits, num_classes)
        D.check_disjoint(self.splits)

    # ------------------------------------------------------------------------------------
    def load(self, cfg, device: torch.device, dtype: torch.dtype, rank: int = 0, world: int = 1) -> None:
        """Decide how rollouts are read and hold the fixed sets (this process's share)."""
        self.device, self.dtype = device, dtype
        self.normalize = D.InputNormalize(self.model, device)  # uint8 images to the model's input
        # the host's CPUs, shared by the processes of this host: all but two of a process's share make
        # rollout images (the training process and its critic thread keep two busy; on one H100 host a
        # ViT-Ti update of 0.3-0.4 s needs 256 images of about 5 ms each, some four workers' worth);
        # every one decodes the fixed sets before the first update
        share = max(1, D.worker_count(1 << 16) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.workers = cfg.data_workers if cfg.data_workers is not None else max(1, share - 2)
        decoders = share
        mode = cfg.rollout_data
        if mode == "auto":
            mode = "held" if self.augment == "none" and len(self.pool) <= P.SMALL_POOL_MAX_IMAGES else "stream"
        if mode == "held" and self.augment != "none":
            raise ValueError("--rollout-data held: the rollouts are augmented (--augment), so they are made anew for "
                             "every update: use --rollout-data stream")
        self.rollout_mode = mode
        self.held_rollout, self.rollout_rows = None, None
        if mode == "held":
            held = self._hold(self.pool, None, decoders, count=rank == 0)  # (every process holds it all)
            if len(held) == 0:
                raise ValueError(f"no readable image in the rollout split ({len(self.pool)} files)")
            self.held_rollout = held
            # an unreadable file's rows: the next readable image, as the stream makes it
            kept = torch.tensor(held.index, dtype=torch.long)
            nxt = torch.searchsorted(kept, torch.arange(len(self.pool)))
            self.rollout_rows = torch.where(nxt < len(kept), nxt, torch.zeros_like(nxt)).to(device)
        elif self.augment != "none" and len(self.pool) * max(1, self.workers) <= DECODED_CACHE_MAX:
            self.pool.keep_decoded()  # small augmented pools: each worker decodes each file once
        self.rollout_images = P.RolloutImages(self.pool, cfg.ppo.seed, self.augment == "strong", cfg.cutmix_prob,
                                              self.model.patch_embed.patch_size[0])

        # the checks' images: QC (+ the rollout split, + dev: ours), cut into fixed shards; this
        # process holds every world-th image of each shard
        parts = [self.qc_set] + ([self.rollout_set] if cfg.qc_with_rollout else []) + ([self.dev_set] if cfg.qc_with_dev else [])
        checks = D.joined(parts) if len(parts) > 1 else self.qc_set
        shards = D.fixed_shards(len(checks), cfg.qc_shards)
        mine = [i for s in shards for i in s[rank::world]]
        self.checks = self._hold(checks, mine, decoders)
        shard_of = {i: k for k, s in enumerate(shards) for i in s}
        self.check_shards: List[torch.Tensor] = []
        for k in range(len(shards)):
            rows = [r for r, i in enumerate(self.checks.index) if shard_of[i] == k]
            self.check_shards.append(torch.tensor(rows, dtype=torch.long, device=device))
        self.dev = self._hold(self.dev_set, range(rank, len(self.dev_set), world), decoders)
        self.local_sizes = [len(s) for s in self.check_shards] + [len(self.dev)]

    def _hold(self, dataset, indices: Optional[Sequence[int]], workers: int, count: bool = True) -> D.HeldImages:
        n = len(dataset) if indices is None else len(indices)
        held = D.hold(dataset, self.model, self.device, indices, num_workers=workers if n >= 256 else 0,
                      normalize=self.normalize)
        self.skipped += len(held.skipped) if count else 0
        self.warned.update(p for p, _ in held.skipped)
        return held

    # ------------------------------------------------------------------------------------
    def start(self, sampler: P.RolloutSampler, u0: int, local: Sequence[int]) -> None:
        """Start making the batches of updates ``u0 + 1, ...`` (``stream``) from a copy of ``sampler``."""
        if self.rollout_mode == "stream" and self.stream is None:
            shape = self.checks.images.shape[1:]  # the model's input, as uint8
            self.stream = P.RolloutStream(self.rollout_images, sampler, u0, local, self.workers, shape)

    def rollout(self, u: int, idx: List[int], local: Sequence[int]) -> torch.Tensor:
        """The model inputs of update ``u``'s rollout images at positions ``local`` of the global
        batch ``idx``, on the device in the run's dtype."""
        if self.rollout_mode == "held":
            rows = self.rollout_rows[torch.tensor([idx[m] for m in local], device=self.device)]
            return self.held_rollout.inputs(rows, self.dtype)
        keys, x, skipped = next(self.stream)
        expect = [(u, idx[m]) for m in local]
        if keys != expect:
            raise RuntimeError(f"streamed rollout batch {keys[:2]}... is not update {u}'s {expect[:2]}...")
        for path, error in skipped:
            self.skipped += 1
            if path not in self.warned:
                self.warned.add(path)
                D.warn_unreadable(path, error)
        # a view of the stream's ring, copied here (before its slot can be reused)
        return self.normalize(x.to(self.device), self.dtype)

    def made_here(self, u: int, indices: Sequence[int]) -> torch.Tensor:
        """The model inputs of pool images ``indices`` as update ``u``'s rollout sees them, made in
        this process (what the workers make; for checks and tests)."""
        x = torch.stack([self.rollout_images[(u, int(i))][1] for i in indices])
        return self.normalize(x.to(self.device), self.dtype)

    def close(self) -> None:
        """Stop the worker processes (the next :meth:`start` makes new ones)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

