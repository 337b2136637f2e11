"""The rollout pool of a training run: the order its images are drawn in, how each is made, and
the processes that make the next batches while an update runs.

- :class:`RolloutSampler` draws rollout batches from successive seeded random permutations (each
  image once per pass over the split: the paper's 299,776 = 1,171 x 256 images are one pass), with
  a resumable state (the position in the pass included).
- :func:`train_transform` is the rollout preprocessing, as ``uint8``; it optionally augments the
  images of small pools (``light``: random-resized crop with scale (0.5, 1) and horizontal flip;
  ``strong``: scale (0.25, 1), flip and RandAugment, plus label-free patch CutMix,
  :func:`cutmix_patches`); the paper trains without stochastic augmentation, so it is off by default.
- :class:`RolloutImages` is pool image ``i`` as update ``u`` sees it, seeded per ``(seed, u, i)``;
  an unreadable file is replaced by the next readable image of the split and reported.
- :class:`RolloutStream` makes the next updates' batches in worker processes (streaming: no
  process holds the split's images; each holds the batches in flight).
"""
from __future__ import annotations

import gc
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from timm.data import create_transform

from ..data import data_config, uint8_transform

__all__ = ["AUGMENT_LEVELS", "MAX_UNREADABLE_IN_A_ROW", "SMALL_POOL_MAX_IMAGES", "RolloutImages", "RolloutSampler", "RolloutStream", "augment_level",
           "cutmix_patches", "seed_all", "train_transform"]


AUGMENT_LEVELS = ("none", "light", "strong")
SMALL_POOL_MAX_IMAGES = 10_000  # a small pool: the small-pool recipe (config.RECIPES), rollouts held or decoded once


def augment_level(augment: Union[bool, str, None]) -> str:
    """The augmentation level named by ``augment``: ``False``/``None`` -> ``"none"``, ``True`` ->
    ``"light"`` (the meaning of the earlier boolean flag), or one of :data:`AUGMENT_LEVELS`."""
    if augment is None or augment is False:
        return "none"
    if augment is True:
        return "light"
    if isinstance(augment, str) and augment.lower() in AUGMENT_LEVELS:
        return augment.lower()
    raise ValueError(f"augment must be one of {AUGMENT_LEVELS} (or a bool), got {augment!r}")


def train_transform(model: torch.nn.Module, augment: Union[bool, str] = False, **overrides: Any) -> Callable:
    """Rollout preprocessing at the model's input size and interpolation, to a ``uint8`` ``[3, H, W]``
    tensor (:class:`~timm_dora.data.InputNormalize` makes the model's input of it on the device).

    - ``"none"`` (or ``False``): :func:`~timm_dora.data.uint8_transform`, the eval preprocessing.
    - ``"light"`` (or ``True``): timm's training transform kept light for small rollout pools:
      ``RandomResizedCrop(scale=(0.5, 1.0))`` with timm's default aspect ratios, horizontal flip
      with p = 0.5, no colour jitter, no auto-augment, no random erasing.
    - ``"strong"``: ``RandomResizedCrop(scale=(0.25, 1.0))``, flip, and timm's RandAugment
      ``rand-m9-mstd0.5-inc1`` (the DeiT recipe's policy, no random erasing). The trainer adds
      label-free patch CutMix between pool images on top (:func:`cutmix_patches`).

    Randomness comes from the global ``random`` (timm's crop and RandAugment), ``numpy`` and
    ``torch`` (the flip) RNGs: seed all three, or the DataLoader workers, for reproducible
    augmentation. Not in the paper (it trains on 300k images without
    stochastic augmentation): for the 700-image pools here.
    """
    level = augment_level(augment)
    if level == "none":
        return uint8_transform(model, **overrides)
    cfg = data_config(model, **overrides)
    strong = level == "strong"
    return create_transform(
        input_size=cfg["input_size"],
        is_training=True,
        scale=(0.25, 1.0) if strong else (0.5, 1.0),
        hflip=0.5,
        color_jitter=None,
        auto_augment="rand-m9-mstd0.5-inc1" if strong else None,
        re_prob=0.0,
        interpolation=cfg["interpolation"],
        use_prefetcher=True,
    )


def cutmix_patches(
    a: torch.Tensor, b: torch.Tensor, patch: int, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, Tuple[int, int, int, int]]:
    """Label-free CutMix on the patch grid: a copy of image ``a`` ``[C, H, W]`` with a rectangle
    of whole ``patch`` x ``patch`` tiles taken from ``b`` (same shape), and the rectangle
    ``(top, left, rows, cols)`` in tiles.

    As in CutMix, ``lam ~ U(0, 1)`` and the rectangle covers ``1 - lam`` of the grid
    (``rows = round(gh * sqrt(1 - lam))``, ``cols`` likewise) at a uniform position inside it;
    aligned to the patch grid, so every token of the result is a token of ``a`` or of ``b``. No
    label is mixed: DORA's rollout reward compares the pruned forward with the native forward of
    the same (mixed) input, so any image is a valid rollout input. Draws 3 numbers from
    ``generator`` (the global RNG when ``None``).
    """
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(f"cutmix_patches needs two [C, H, W] images of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    gh, gw = a.shape[1] // patch, a.shape[2] // patch
    if gh * patch != a.shape[1] or gw * patch != a.shape[2]:
        raise ValueError(f"image size {tuple(a.shape[1:])} is not a multiple of the patch size {patch}")
    lam = float(torch.rand((), generator=generator))
    cut = (1.0 - lam) ** 0.5
    rows, cols = int(round(gh * cut)), int(round(gw * cut))
    top = int(torch.randint(gh - rows + 1, (), generator=generator))
    left = int(torch.randint(gw - cols + 1, (), generator=generator))
    out = a.clone()
    ys, xs = slice(top * patch, (top + rows) * patch), slice(left * patch, (left + cols) * patch)
    out[:, ys, xs] = b[:, ys, xs]
    return out, (top, left, rows, cols)


class RolloutSampler:
    """Endless stream of index batches over ``range(n)`` from successive random permutations.

    Each permutation is ``torch.randperm(n, generator=generator)``; a batch that reaches the end
    of one permutation continues into the next, so every batch has exactly ``batch`` indices
    (an index can repeat within a batch only across such a boundary, or when ``batch > n``).
    ``generator`` is a ``torch.Generator`` or an int seed. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore the current permutation, the position in it, the
    epoch count and the generator state, so a resumed run yields exactly the batches the
    uninterrupted one would have.

        sampler = RolloutSampler(len(pool), 64, seed)
        idx = next(sampler)              # list of 64 ints
    """

    def __init__(self, n: int, batch: int, generator: Union[torch.Generator, int, None] = None):
        if n < 1 or batch < 1:
            raise ValueError(f"need n >= 1 and batch >= 1, got n={n}, batch={batch}")
        if generator is None or isinstance(generator, int):
            seed = 0 if generator is None else generator
            generator = torch.Generator().manual_seed(seed)
        self.n, self.batch, self.generator = int(n), int(batch), generator
        self.permutation: Optional[torch.Tensor] = None
        self.position = 0  # next index into ``permutation``
        self.epoch = 0  # permutations drawn so far

    def __iter__(self) -> Iterator[List[int]]:
        return self

    def __next__(self) -> List[int]:
        out: List[int] = []
        while len(out) < self.batch:
            if self.permutation is None or self.position >= self.n:
                self.permutation = torch.randperm(self.n, generator=self.generator)
                self.position = 0
                self.epoch += 1
            take = min(self.batch - len(out), self.n - self.position)
            out.extend(self.permutation[self.position:self.position + take].tolist())
            self.position += take
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {
            "n": self.n,
            "batch": self.batch,
            "permutation": None if self.permutation is None else self.permutation.clone(),
            "position": self.position,
            "epoch": self.epoch,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["n"]) != self.n or int(state["batch"]) != self.batch:
            raise ValueError(
                f"sampler state is for n={state['n']}, batch={state['batch']}; this sampler has n={self.n}, batch={self.batch}"
            )
        perm = state["permutation"]
        self.permutation = None if perm is None else torch.as_tensor(perm, dtype=torch.long).clone()
        self.position = int(state["position"])
        self.epoch = int(state["epoch"])
        self.generator.set_state(state["generator"])


def seed_all(value: int) -> None:
    """Seed ``random``, ``numpy`` and ``torch``'s global RNGs (the ones timm's and torchvision's
    transforms draw from) from one integer."""
    import random

    import numpy as np

    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


MAX_UNREADABLE_IN_A_ROW = 16  # more unreadable files in a row than this: the data is broken, not one file


class RolloutImages(torch.utils.data.Dataset):
    """The rollout pool as the training run sees it: item ``(u, i)`` is pool image ``i`` as made for
    update ``u``, ``(key, uint8 image, skipped)``. With an augmenting transform every draw is seeded
    by ``(seed, u, i)`` in each RNG the transforms use (``random`` for timm's crop and RandAugment,
    ``numpy``, ``torch`` for the flip and the CutMix), so an item is the same in any process,
    worker or order: resumable, and equal for any world size. ``strong``: with probability
    ``cutmix_prob`` a patch-aligned rectangle of another pool image (itself augmented) is pasted in,
    label-free (:func:`cutmix_patches`).

    An unreadable file (corrupt, truncated, not an image) does not end the run: image ``i`` is
    replaced by the next readable one of the split (``i + 1``, ``i + 2``, ... wrapping around), and
    ``skipped`` lists the ``(path, error)`` of each file passed over, for the trainer to warn about
    and count. More than :data:`MAX_UNREADABLE_IN_A_ROW` in a row is an error that names the first."""

    def __init__(self, images: torch.utils.data.Dataset, seed: int, strong: bool = False, cutmix_prob: float = 0.0,
                 patch: int = 16):
        self.images, self.seed, self.strong, self.cutmix_prob, self.patch = images, seed, strong, cutmix_prob, patch

    def __len__(self) -> int:
        return len(self.images)

    def _image(self, i: int, skipped: List[Tuple[str, str]]) -> torch.Tensor:
        n = len(self.images)
        for step in range(min(n, MAX_UNREADABLE_IN_A_ROW + 1)):
            j = (i + step) % n
            try:
                return self.images[j][0]
            except Exception as e:  # the file: left out, named
                skipped.append((self.images.paths[j], f"{type(e).__name__}: {e}"))
        raise RuntimeError(f"{len(skipped)} unreadable images in a row from {skipped[0][0]} ({skipped[0][1]}): "
                           "check the data")

    def __getitem__(self, key: Tuple[int, int]) -> Tuple[Tuple[int, int], torch.Tensor, List[Tuple[str, str]]]:
        u, i = key
        n = len(self.images)
        seed_all((self.seed * 1_000_003 + u) * 1_000_003 + i)
        skipped: List[Tuple[str, str]] = []
        img = self._image(i, skipped)
        if self.strong and n > 1 and float(torch.rand(())) < self.cutmix_prob:
            j = int(torch.randint(n - 1, ()))
            img, _ = cutmix_patches(img, self._image(j + (j >= i), skipped), self.patch)
        return key, img, skipped


class _RingWriter(torch.utils.data.Dataset):
    """Item ``(key, slot, row)``: ``pool[key]``'s image written into ``ring[slot, row]`` (shared
    memory, mapped in every worker before it was forked); returns ``(key, slot, skipped)``: no
    image crosses a process boundary."""

    def __init__(self, pool: RolloutImages, ring: torch.Tensor):
        self.pool, self.ring = pool, ring

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, item: Tuple[Tuple[int, int], int, int]) -> Tuple[Tuple[int, int], int, List[Tuple[str, str]]]:
        key, slot, row = item
        _, img, skipped = self.pool[key]
        self.ring[slot, row].copy_(img)
        return key, slot, skipped


def _collate_pieces(items: List[Tuple[Tuple[int, int], int, List]]) -> Tuple[List, List[int], List]:
    return [k for k, _, _ in items], [s for _, s, _ in items], [x for _, _, ss in items for x in ss]


def _background_worker(_: int) -> None:
    """DataLoader worker start: a lower CPU priority than the training process, whose host work
    (launching the GPU's kernels) is on the update's critical path."""
    os.nice(10)


class RolloutStream:
    """This process's rollout batches, ``next(stream)`` -> ``(keys, uint8 images, skipped)`` for the
    next update, made ahead in ``workers`` processes while the training process runs the current
    update (``workers=0``: made in this process, on demand).

    The batches follow a copy of the run's :class:`RolloutSampler` from update ``u0 + 1`` on, each
    sliced to this process's share (``local``, positions in the global batch): under ``torchrun``
    each process reads only its own images. The caller checks the keys against the batch it draws
    itself. A batch is cut into ``chunk``-image pieces that workers make in parallel, about
    ``ahead`` batches in flight.

    The workers write the images straight into :attr:`ring`, ``slots`` batches of ``uint8`` images
    ``shape`` in shared memory made before they were forked; only keys travel through the loader's
    queues. ``next`` returns a view of one slot, valid while at most two more batches are asked for
    (the loader's workers run at most ``slots - 3`` batches ahead): copy it first. (Received as tensors,
    each 256-image batch cost the training process about 0.1 s on an H100 host, a quarter of a
    ViT-Ti update: unpickling, mapping fresh shared memory and concatenating the pieces.) Nothing
    grows with the split: a 300,000-image split costs the file list and the sampler's permutation.
    :meth:`close` stops the workers."""

    def __init__(self, pool: RolloutImages, sampler: RolloutSampler, u0: int, local: Sequence[int], workers: int,
                 shape: Sequence[int], chunk: int = 32, ahead: int = 2):
        import copy

        ahead_sampler = copy.deepcopy(sampler)
        self.local, self.chunk = list(local), max(1, chunk)
        self.pieces = -(-len(self.local) // self.chunk)  # pieces per batch
        kw, in_flight = {}, 0
        if workers > 0:  # each worker keeps up to `prefetch_factor` pieces in flight
            factor = max(1, -(-ahead * self.pieces // workers)) if workers < ahead * self.pieces else 1
            kw = dict(prefetch_factor=factor, worker_init_fn=_background_worker)
            in_flight = workers * factor
        # the batch being read, the batches in flight (one more where a batch straddles) and one spare
        self.slots = -(-in_flight // self.pieces) + 3
        self.ring = torch.empty((self.slots, len(self.local), *shape), dtype=torch.uint8).share_memory_()

        def pieces() -> Iterator[List[Tuple[Tuple[int, int], int, int]]]:
            u = u0
            while True:
                u += 1
                idx = next(ahead_sampler)
                slot = (u - u0 - 1) % self.slots
                items = [((u, idx[m]), slot, row) for row, m in enumerate(self.local)]
                for s in range(0, len(items), self.chunk):
                    yield items[s : s + self.chunk]

        self.loader = torch.utils.data.DataLoader(_RingWriter(pool, self.ring), batch_sampler=pieces(),
                                                  num_workers=workers, collate_fn=_collate_pieces,
                                                  generator=torch.Generator(), **kw)
        # no pinning thread: it would touch CUDA while a step is captured. The workers are forked
        # here: objects of this process that only a cycle collection would free (CUDA graphs,
        # events, tensors of an earlier trainer) must never be freed in a worker, where touching
        # CUDA aborts it; frozen, the workers' collector never looks at them
        gc.freeze()
        try:
            self.it = iter(self.loader)
        finally:
            gc.unfreeze()

    def __next__(self) -> Tuple[List[Tuple[int, int]], torch.Tensor, List[Tuple[str, str]]]:
        keys, slots, skipped = [], set(), []
        for _ in range(self.pieces):
            k, s, x = next(self.it)
            keys += k
            slots.update(s)
            skipped += x
        if len(slots) != 1:
            raise RuntimeError(f"a rollout batch spans ring slots {sorted(slots)}")
        return keys, self.ring[slots.pop()], skipped

    def close(self) -> None:
        # the DataLoader's iterator stops its workers when it is released; the loader's index
        # generator refers to this object: dropped, the ring goes with the last reference to it
        self.it = self.loader = None
