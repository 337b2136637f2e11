"""The data that the training and evaluation commands read (paper App. E.1).

Preprocessing
    :func:`eval_transform` is the backbone's own deterministic timm preprocessing (bicubic resize of
    the short side to ``size / crop_pct``, center crop, normalisation with the ``pretrained_cfg``
    mean/std). Every split uses it (training may augment its rollout pool:
    :mod:`timm_dora.train.pool`). Training moves images as ``uint8`` (:func:`uint8_transform`, a
    quarter of float32's bytes) and normalises them on the device (:class:`InputNormalize`), with
    the same arithmetic as the float transform, so the inputs are the same bit for bit.

Datasets
    :class:`LabelsCSVDataset` reads one split of a ``path,label,synset,set,split`` CSV (the format
    of ``shared/data/imagenet-mini/labels.csv``); :class:`ImageFolderDataset` reads a
    ``root/<class>/<image>`` tree. Both return ``(image, label, index)`` and expose ``paths``
    (absolute) and ``labels``. :func:`open_split` picks one from a command-line spec.

Protocol helpers
    :func:`check_disjoint` refuses overlapping splits (same file, or a byte-identical copy under
    another name) from one ``stat`` per file and a few reads; :func:`check_labels` refuses labels
    outside the model's classes; :func:`fixed_shards` cuts the QC pool into fixed shards;
    :func:`preload` stacks a small pool into one tensor and :func:`hold` decodes a fixed set once
    into ``uint8`` on the device (:class:`HeldImages`), leaving out unreadable files with a warning;
    :class:`ReadableBatches` streams a split in batches (evaluation) by the same rule.
"""
from __future__ import annotations

import csv
import hashlib
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.data.readers.img_extensions import get_img_extensions
from timm.utils.misc import natural_key

__all__ = ["CONTENT_CHECK_MAX", "HeldImages", "ImageFolderDataset", "InputNormalize", "LabelsCSVDataset", "ReadableBatches",
           "check_disjoint", "check_labels",
           "data_config", "eval_transform", "fixed_shards", "hold", "joined", "open_split", "preload", "uint8_transform",
           "warn_unreadable", "worker_count"]

PathLike = Union[str, os.PathLike]
CSV_REQUIRED_COLUMNS = ("path", "label", "split")  # ``synset`` and ``set`` are optional


# --------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------
def data_config(model: torch.nn.Module, **overrides: Any) -> Dict[str, Any]:
    """timm's data config for ``model`` (``resolve_data_config({}, model=model)``).

    One correction: timm keeps the *pretrained* ``input_size`` in ``pretrained_cfg`` when a model
    is built with another ``img_size`` (e.g. DINOv2 is 518 there, 224 in the paper); the size the
    model was built for (``model.patch_embed.img_size``) wins. ``overrides`` are passed to timm as
    ``args`` (e.g. ``crop_pct=0.875`` for a 256-pixel resize before a 224 crop; ``img_size=256`` for
    square 256-pixel inputs); as in timm, an override of ``None`` is none.
    """
    args = dict(overrides)
    img_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if args.get("input_size") is None and args.get("img_size") is None and img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        cfg_size = tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))
        if cfg_size[1:] != (h, w):
            args["input_size"] = (cfg_size[0], int(h), int(w))
    return resolve_data_config(args, model=model)


def eval_transform(model: torch.nn.Module, **overrides: Any) -> Callable:
    """The backbone's deterministic preprocessing: ``create_transform(**data_config(model))``.

    For the shared backbones this is exactly timm's own eval transform, e.g. ViT-Tiny AugReg:
    bicubic resize to 248, center crop 224, mean = std = 0.5.
    """
    return create_transform(**data_config(model, **overrides), is_training=False)


def uint8_transform(model: torch.nn.Module, **overrides: Any) -> Callable:
    """:func:`eval_transform` without its last two steps (to float, normalise): a ``uint8``
    ``[3, H, W]`` tensor (timm's ``use_prefetcher`` form). :class:`InputNormalize` finishes it."""
    return create_transform(**data_config(model, **overrides), is_training=False, use_prefetcher=True)


class InputNormalize:
    """``uint8`` images ``[N, 3, H, W]`` to the model's input: ``x / 255``, less the mean, over the
    std (the model's data config), then ``dtype``. The same operations in the same order as
    torchvision's ``ToTensor`` and ``Normalize`` (float32 division by 255, then ``sub_``, ``div_``),
    so on the CPU the result equals :func:`eval_transform`'s bit for bit; on CUDA, PyTorch divides
    by a scalar as a product with its inverse (a last-bit difference before the cast to bf16)."""

    def __init__(self, model: torch.nn.Module, device: Union[str, torch.device] = "cpu", **overrides: Any):
        cfg = data_config(model, **overrides)
        self.mean = torch.tensor(cfg["mean"], dtype=torch.float32, device=device).view(-1, 1, 1)
        self.std = torch.tensor(cfg["std"], dtype=torch.float32, device=device).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"InputNormalize takes uint8 images, got {x.dtype}")
        x = x.to(device=self.mean.device, dtype=torch.float32).div(255)
        return x.sub_(self.mean).div_(self.std).to(dtype)

# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------
class _ImageList(torch.utils.data.Dataset):
    """A list of image files with integer labels; items are ``(image, label, index)``.

    With ``transform=None`` the image is the RGB ``PIL.Image``; with a timm transform it is a
    ``[3, H, W]`` float tensor.
    """

    def __init__(self, paths: Sequence[str], labels: Sequence[int], transform: Optional[Callable] = None):
        self.paths: List[str] = list(paths)
        self.labels: List[int] = [int(x) for x in labels]
        self.transform = transform
        self._decoded: Optional[Dict[int, Any]] = None

    def keep_decoded(self) -> None:
        """Keep every decoded RGB image in memory after its first read (random transforms still
        run on every access): for small pools that are augmented anew each pass."""
        if self._decoded is None:
            self._decoded = {}

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> Image.Image:
        """The decoded RGB image ``index`` (any error of an unreadable file propagates)."""
        img = None if self._decoded is None else self._decoded.get(index)
        if img is None:
            with open(self.paths[index], "rb") as f:
                img = Image.open(f).convert("RGB")
            if self._decoded is not None:
                self._decoded[index] = img
        return img

    def __getitem__(self, index: int) -> Tuple[Any, int, int]:
        img = self.read(index)
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[index], index

    @property
    def num_classes(self) -> int:
        """``max(label) + 1`` (labels are global indices, not necessarily all present)."""
        return max(self.labels) + 1 if self.labels else 0


class LabelsCSVDataset(_ImageList):
    """Rows of one ``split`` of a labels CSV (columns ``path,label,synset,set,split``).

    ``path`` is relative to ``root`` (default: the CSV's folder) or absolute; :attr:`paths` are
    absolute and normalised, not resolved through links (:func:`check_disjoint` compares files, not
    names). ``label`` is the 0-based class index (ImageNet-1k index for imagenet-mini). Only ``path``, ``label`` and
    ``split`` are required; ``synset`` is kept in :attr:`synsets` when present. Rows keep the
    CSV's order. Raises ``FileNotFoundError`` for a missing CSV or image file and ``ValueError``
    for missing columns, a bad label, an unknown split (listing the available ones) or an empty one.
    """

    def __init__(
        self,
        csv_path: PathLike,
        split: str,
        transform: Optional[Callable] = None,
        root: Optional[PathLike] = None,
    ):
        csv_path = Path(csv_path)
        if not csv_path.is_file():
            raise FileNotFoundError(f"labels CSV not found: {csv_path}")
        root = Path(root).resolve() if root is not None else csv_path.resolve().parent
        base = str(root)
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in (reader.fieldnames or [])]
            missing = [c for c in CSV_REQUIRED_COLUMNS if c not in columns]
            if missing:
                raise ValueError(
                    f"{csv_path}: missing column(s) {', '.join(missing)} "
                    f"(found: {', '.join(columns) or 'none'}; expected path,label,synset,set,split)"
                )
            reader.fieldnames = columns
            rows = list(reader)
        if not rows:
            raise ValueError(f"{csv_path}: no rows (empty labels CSV)")
        available = sorted({(r["split"] or "").strip() for r in rows})
        if split not in available:
            raise ValueError(
                f"{csv_path}: unknown split {split!r}; available: {', '.join(repr(s) for s in available) or 'none'}"
            )
        paths, labels, synsets = [], [], []
        for line, r in enumerate(rows, start=2):  # line 1 is the header
            if (r["split"] or "").strip() != split:
                continue
            rel = (r["path"] or "").strip()
            try:
                label = int(r["label"])
            except (TypeError, ValueError):
                raise ValueError(f"{csv_path}:{line}: label {r['label']!r} is not an integer") from None
            if not rel:
                raise ValueError(f"{csv_path}:{line}: empty path")
            path = os.path.join(base, rel)  # (no syscall per row: 300k rows in 0.5 s; '..' after a link: resolved)
            paths.append(os.path.realpath(path) if ".." in rel else os.path.normpath(path))
            labels.append(label)
            synsets.append((r.get("synset") or "").strip())
        if not paths:
            raise ValueError(f"{csv_path}: split {split!r} is empty")
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(
                f"{csv_path}: {len(absent)} image file(s) of split {split!r} not found under {root}, e.g. {absent[0]}"
            )
        super().__init__(paths, labels, transform)
        self.csv_path = str(csv_path.resolve())
        self.root = str(root.resolve())
        self.split = split
        self.synsets: List[str] = synsets


def _load_class_map(class_map: Union[PathLike, Mapping[str, int]]) -> Dict[str, int]:
    """``{folder name: label}`` from a dict, a CSV with ``synset,label`` columns, or a text file.

    Text file: one class per line in label order; the first whitespace-separated token is the
    folder name (``classes.txt``'s ``synset<TAB>name`` lines, or timm's plain one-name-per-line
    class maps). CSV: every (synset, label) pair, e.g. ``labels.csv``; conflicts are errors.
    """
    if isinstance(class_map, Mapping):
        return {str(k): int(v) for k, v in class_map.items()}
    path = Path(class_map)
    if not path.is_file():
        raise FileNotFoundError(f"class map not found: {path}")
    out: Dict[str, int] = {}
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            cols = [c.strip() for c in (reader.fieldnames or [])]
            missing = [c for c in ("synset", "label") if c not in cols]
            if missing:
                raise ValueError(f"class map {path}: missing column(s) {', '.join(missing)}")
            reader.fieldnames = cols
            for line, r in enumerate(reader, start=2):
                name, label = r["synset"].strip(), int(r["label"])
                if out.setdefault(name, label) != label:
                    raise ValueError(f"class map {path}:{line}: {name!r} maps to both {out[name]} and {label}")
        return out
    with open(path) as f:
        names = [ln.split()[0] for ln in f if ln.strip()]
    for i, name in enumerate(names):
        if name in out:
            raise ValueError(f"class map {path}: {name!r} listed twice (lines {out[name] + 1} and {i + 1})")
        out[name] = i
    return out


class ImageFolderDataset(_ImageList):
    """Images under ``root/<class>/...`` (timm ``ImageDataset`` folder semantics).

    Images are found recursively (timm's image extensions); the class of an image is the name of
    its leaf folder; samples are in timm's natural-sort order of their paths. Labels:

    * ``class_map=None``: index of the folder name among the sorted (natural order) folder names,
      as timm and torchvision do: labels are local to this tree.
    * ``class_map``: ``{folder name: label}`` given as a dict, a CSV with ``synset,label``
      columns (e.g. ``labels.csv``) or a text file with one class per line in label order whose
      first token is the folder name (e.g. ``classes.txt``): labels are global (ImageNet-1k
      indices for synset folders). A folder absent from the map is an error, not skipped.

    ``class_to_idx`` holds the mapping used. Images directly under ``root`` are an error.
    """

    def __init__(
        self,
        root: PathLike,
        transform: Optional[Callable] = None,
        class_map: Optional[Union[PathLike, Mapping[str, int]]] = None,
    ):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder not found: {root}")
        exts = get_img_extensions(as_set=True)
        found: List[Tuple[str, str]] = []
        root_abs = str(root.resolve())
        for dirpath, _, files in os.walk(root_abs, followlinks=True):
            for name in files:
                if os.path.splitext(name)[1].lower() in exts:
                    found.append((os.path.join(dirpath, name), os.path.basename(dirpath)))
        if not found:
            raise ValueError(f"no images found under {root}")
        loose = [p for p, _ in found if os.path.dirname(p) == root_abs]
        if loose:
            raise ValueError(f"{root}: {len(loose)} image(s) directly under the root, not in a class folder, e.g. {loose[0]}")
        found.sort(key=lambda pc: natural_key(pc[0]))
        classes = sorted({c for _, c in found}, key=natural_key)
        if class_map is None:
            class_to_idx = {c: i for i, c in enumerate(classes)}
        else:
            class_to_idx = _load_class_map(class_map)
            unknown = [c for c in classes if c not in class_to_idx]
            if unknown:
                raise ValueError(f"{root}: folder(s) not in the class map: {', '.join(unknown[:5])}"
                                 + (" ..." if len(unknown) > 5 else ""))
        super().__init__([p for p, _ in found], [class_to_idx[c] for _, c in found], transform)
        self.root = str(root.resolve())
        self.classes = classes
        self.class_to_idx = class_to_idx


def joined(datasets: Sequence[_ImageList], transform: Optional[Callable] = None) -> _ImageList:
    """One dataset of every image of ``datasets``, in their order, with their labels, read through
    ``transform`` (e.g. a training pool made of several splits)."""
    return _ImageList([p for ds in datasets for p in ds.paths], [y for ds in datasets for y in ds.labels], transform)


def open_split(
    spec: PathLike,
    split: str,
    transform: Optional[Callable] = None,
    class_map: Optional[Union[PathLike, Mapping[str, int]]] = None,
) -> _ImageList:
    """The dataset named by a command-line ``spec``.

    * a ``.csv`` file, or a folder holding ``labels.csv``: :class:`LabelsCSVDataset` of ``split``;
    * any other folder: :class:`ImageFolderDataset` of ``spec/split`` if that subfolder exists,
      else of ``spec`` itself (``split`` ignored; ``class_map`` as in :class:`ImageFolderDataset`).
    """
    spec = Path(spec)
    if spec.is_file():
        return LabelsCSVDataset(spec, split, transform)
    if spec.is_dir():
        if (spec / "labels.csv").is_file():
            return LabelsCSVDataset(spec / "labels.csv", split, transform)
        folder = spec / split if split and (spec / split).is_dir() else spec
        return ImageFolderDataset(folder, transform, class_map=class_map)
    raise FileNotFoundError(f"data spec not found (expected a labels CSV or an image folder): {spec}")


# --------------------------------------------------------------------------------------------
# Protocol helpers
# --------------------------------------------------------------------------------------------
_HASH_BYTES = 64 * 1024


def _content_key(path: str, size: int) -> Tuple[int, str]:
    with open(path, "rb") as f:
        head = f.read(_HASH_BYTES)
    return size, hashlib.sha1(head).hexdigest()


CONTENT_CHECK_MAX = 20_000  # splits up to this many files are also compared by content


def check_disjoint(datasets: Mapping[str, Any], content: bool = True, content_max: int = CONTENT_CHECK_MAX) -> None:
    """Raise ``ValueError`` if any two splits share an image.

    ``datasets`` maps split names to datasets with a ``paths`` attribute (or to sequences of
    paths). Two checks per pair: the same file (its device and inode, from one ``stat`` per file:
    the same file under another name or through a link), then (``content=True``, for two splits
    of at most ``content_max`` files each) the same bytes under another name, compared by (file
    size, SHA-1 of the first 64 KiB): exact for files up to 64 KiB and, for JPEGs, practically
    exact beyond. A file is read only when a file of the other split has its exact size. So a
    300,000-image split costs 300,000 ``stat`` calls and no read (the paper's 16,384 QC and 10,240
    dev images are compared by content); copies of one file in two folders of a split that large
    are not looked for (splits drawn by ``timm-dora partition`` hold each file once), nor are
    re-encoded or resized copies. The message names both splits, the overlap count and one example.
    """
    names = list(datasets)
    stats: Dict[str, Dict[Tuple[int, int], Tuple[str, int]]] = {}  # split -> (dev, inode) -> (path, size)
    for name in names:
        ds = datasets[name]
        stats[name] = {}
        for p in getattr(ds, "paths", ds):
            st = os.stat(p)
            stats[name].setdefault((st.st_dev, st.st_ino), (p, st.st_size))
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = sorted(stats[a][k][0] for k in set(stats[a]) & set(stats[b]))
            if shared:
                raise ValueError(
                    f"splits {a!r} and {b!r} overlap: {len(shared)} shared file(s), e.g. {shared[0]}"
                )
    if not content:
        return
    names = [name for name in names if len(stats[name]) <= content_max]
    by_size: Dict[int, Dict[str, List[str]]] = defaultdict(lambda: defaultdict(list))
    for name in names:
        for p, size in stats[name].values():
            by_size[size][name].append(p)
    keys: Dict[str, Dict[Tuple[int, str], str]] = {name: {} for name in names}
    for size, splits in by_size.items():
        if len(splits) > 1:  # only sizes that occur in two splits can be copies
            for name, ps in splits.items():
                for p in ps:
                    keys[name].setdefault(_content_key(p, size), p)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = sorted(set(keys[a]) & set(keys[b]), key=lambda k: keys[a][k])
            if same:
                k = same[0]
                raise ValueError(
                    f"splits {a!r} and {b!r} overlap: {len(same)} file(s) with identical content "
                    f"(size + SHA-1 of the first 64 KiB), e.g. {keys[a][k]} ({a}) == {keys[b][k]} ({b})"
                )


def check_labels(datasets: Mapping[str, Any], num_classes: int) -> None:
    """Raise ``ValueError`` naming the split, the file and the label if any label of ``datasets``
    (split name -> dataset with ``labels`` and ``paths``) is outside ``[0, num_classes)``."""
    for name, ds in datasets.items():
        for p, y in zip(ds.paths, ds.labels):
            if not 0 <= y < num_classes:
                raise ValueError(f"split {name!r}: label {y} of {p} is outside the model's {num_classes} classes "
                                 f"(0 to {num_classes - 1})")


def fixed_shards(n: int, num_shards: int) -> List[List[int]]:
    """Split ``range(n)`` into ``num_shards`` contiguous, near-equal index lists.

    The first ``n % num_shards`` shards get one extra index (150 into 8: six of 19, two of 18).
    Deterministic, so the QC shards used round robin by the accuracy feedback are the same in
    every run and on resume.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if n < num_shards:
        raise ValueError(f"cannot cut {n} items into {num_shards} non-empty shards")
    base, extra = divmod(n, num_shards)
    shards, start = [], 0
    for s in range(num_shards):
        size = base + (1 if s < extra else 0)
        shards.append(list(range(start, start + size)))
        start += size
    return shards


@torch.no_grad()
def worker_count(requested: int) -> int:
    """``requested`` DataLoader worker processes, at most one per CPU this process may run on (more
    only compete for the same cores, and the DataLoader warns about them)."""
    if requested < 0:
        raise ValueError(f"the number of data workers must be 0 or more, got {requested}")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cpus = os.cpu_count() or 1
    return min(requested, cpus)


def preload(
    dataset: torch.utils.data.Dataset,
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[torch.dtype] = None,
    batch_size: int = 64,
    num_workers: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """All of ``dataset`` (transformed to tensors) as ``(images [N, C, H, W], labels [N] int64)``.

    Row ``i`` is ``dataset[i]``. ``dtype`` applies to the images only; each batch is converted and
    copied into a preallocated tensor on ``device``, so peak memory is one copy of the pool (1,300
    images at 224 px in float32 are ~0.8 GB). Meant for the small pools here; with an augmenting
    transform it freezes one draw of the augmentation. ``num_workers`` is capped by
    :func:`worker_count`.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError("cannot preload an empty dataset")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False,
                                         num_workers=worker_count(num_workers))
    images: Optional[torch.Tensor] = None
    labels = torch.empty(n, dtype=torch.long)
    pos = 0
    for batch in loader:
        x, y, idx = batch[0], batch[1], batch[2]
        if not isinstance(x, torch.Tensor):
            raise TypeError("preload needs a transform that returns tensors (e.g. eval_transform(model))")
        if images is None:
            images = torch.empty((n,) + tuple(x.shape[1:]), dtype=dtype or x.dtype, device=device)
        k = x.shape[0]
        assert torch.equal(torch.as_tensor(idx), torch.arange(pos, pos + k)), "loader order changed"
        images[pos:pos + k] = x.to(device=images.device, dtype=images.dtype)
        labels[pos:pos + k] = torch.as_tensor(y, dtype=torch.long)
        pos += k
    return images, labels.to(device=images.device)


def warn_unreadable(path: str, error: str) -> None:
    """One line on stderr for an image file that could not be read, and is left out."""
    print(f"timm-dora: warning: skipped unreadable image {path}: {error}", file=sys.stderr)


class _Readable(torch.utils.data.Dataset):
    """Items ``(image or None, label, position, error or None)`` of ``dataset``'s images ``indices``:
    an unreadable file gives ``None`` and the error instead of raising."""

    def __init__(self, dataset: "_ImageList", indices: Sequence[int], transform: Callable):
        self.dataset, self.indices, self.transform = dataset, list(indices), transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, pos: int):
        i = self.indices[pos]
        try:
            return self.transform(self.dataset.read(i)), self.dataset.labels[i], pos, None
        except Exception as e:  # a corrupt, truncated or unsupported file: left out, named
            return None, self.dataset.labels[i], pos, f"{type(e).__name__}: {e}"


def _collate_readable(items):
    good = [it for it in items if it[0] is not None]
    x = torch.stack([it[0] for it in good]) if good else None
    return x, [(it[1], it[2]) for it in good], [(it[2], it[3]) for it in items if it[0] is None]


class ReadableBatches:
    """``(images, labels, positions)`` batches of ``dataset``'s images ``indices`` (all by default)
    in order (``positions`` in ``indices``), read by ``num_workers`` processes with ``transform``
    (the global RNG untouched). An unreadable file is left out with one warning naming it
    (:func:`warn_unreadable`); ``skipped`` holds the ``(path, error)`` of those of the last pass,
    ``images`` counts those read. Evaluation reads with it, and training's fixed sets (:func:`hold`)."""

    def __init__(self, dataset: "_ImageList", transform: Callable, batch_size: int = 64, num_workers: int = 0,
                 indices: Optional[Sequence[int]] = None, pin_memory: bool = False):
        self.dataset = dataset
        self.indices = list(range(len(dataset))) if indices is None else list(indices)
        self.loader = torch.utils.data.DataLoader(
            _Readable(dataset, self.indices, transform), batch_size=batch_size, num_workers=worker_count(num_workers),
            collate_fn=_collate_readable, pin_memory=pin_memory, generator=torch.Generator())
        self.skipped: List[Tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def images(self) -> int:
        return len(self.indices) - len(self.skipped)

    def __iter__(self):
        self.skipped = []
        for x, good, bad in self.loader:
            for pos, error in bad:
                self.skipped.append((self.dataset.paths[self.indices[pos]], error))
                warn_unreadable(*self.skipped[-1])
            if x is not None:
                yield x, torch.tensor([y for y, _ in good], dtype=torch.long), torch.tensor([p for _, p in good])


@dataclass
class HeldImages:
    """A fixed set of images decoded once and held as ``uint8`` (:func:`hold`): ``images`` ``[N, 3,
    H, W]`` and ``labels`` ``[N]`` on one device; on the host ``index`` (each row's index in the
    dataset it was read from) and ``skipped`` (the ``(path, error)`` of the files left out).
    :meth:`inputs` gives model inputs of any rows."""

    images: torch.Tensor
    labels: torch.Tensor
    index: List[int]
    normalize: InputNormalize
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def inputs(self, rows: Union[torch.Tensor, slice, None] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The model inputs of ``rows`` (an index tensor or a slice; all when ``None``) in ``dtype``."""
        return self.normalize(self.images if rows is None else self.images[rows], dtype)


def hold(dataset: "_ImageList", model: torch.nn.Module, device: Union[str, torch.device] = "cpu",
         indices: Optional[Sequence[int]] = None, num_workers: int = 0, batch_size: int = 64,
         normalize: Optional[InputNormalize] = None) -> HeldImages:
    """``dataset``'s images ``indices`` (all by default), decoded once with the model's
    :func:`uint8_transform` in ``num_workers`` processes and held as one ``uint8`` tensor on
    ``device`` (150 KB per 224-px image, a quarter of float32). An unreadable file is left out with
    one warning that names it (:func:`warn_unreadable`) and listed in ``skipped``; the rows keep
    ``indices``' order. Peak memory is the held set (plus, when files were skipped, its
    compaction). ``normalize``: the sets' shared :class:`InputNormalize` (one is made by default)."""
    indices = list(range(len(dataset))) if indices is None else list(indices)
    normalize = normalize or InputNormalize(model, device)
    cfg = data_config(model)
    images = torch.empty((len(indices), *cfg["input_size"]), dtype=torch.uint8, device=device)
    labels = torch.empty(len(indices), dtype=torch.long)
    keep = torch.zeros(len(indices), dtype=torch.bool)
    batches = ReadableBatches(dataset, uint8_transform(model), batch_size, num_workers, indices)
    for x, y, pos in batches:
        images[pos.to(device)] = x.to(device)
        labels[pos] = y
        keep[pos] = True
    rows = keep.nonzero().flatten().tolist()
    if len(rows) < len(indices):
        images = images[torch.tensor(rows, dtype=torch.long, device=images.device)]
    return HeldImages(images, labels[rows].to(device), [indices[r] for r in rows], normalize, batches.skipped)
