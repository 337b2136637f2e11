"""``timm-dora partition``: re-partition the training images of a labels CSV into new splits.

A training recipe on a small pool chooses how its labelled images are split into rollout / QC /
dev; the reserved ``test`` rows must never move. This command takes the rows of the ``--from``
splits (default ``rollout qc dev``), shuffles them with ``--seed`` and deals them out in the
order of ``--sizes`` (``rollout=400 qc=300 dev=300``); every other row (``test``) is copied as it
is. Images are never dropped: the sizes must add up to the rows taken. Paths are rewritten
relative to the output CSV's folder, so the new file works from wherever it is written::

    timm-dora partition --labels ../shared/data/imagenet-mini/labels.csv \\
        --sizes rollout=400 qc=300 dev=300 --seed 0 --out runs/labels_400_300_300.csv
    timm-dora-train ... --data runs/labels_400_300_300.csv

``--folder`` draws the splits from an image folder instead (ImageNet's ``train/``, laid out
``<synset>/<image>``): its images are shuffled with ``--seed`` and dealt out in the order of
``--sizes``, disjoint by construction; images not dealt are left out of the CSV. Labels are the
folder's index among the sorted folder names (for ImageNet-1k's 1,000 synset folders, the standard
class index), or ``--class-map``'s::

    timm-dora partition --folder /data/imagenet/train --sizes rollout=299776 qc=16384 dev=10240 \\
        --seed 0 --out runs/imagenet_splits.csv
"""
from __future__ import annotations

import argparse
import csv
import os
import random
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["add_parser", "partition_csv", "partition_folder", "partition_rows"]


def _deal(items: Sequence[int], sizes: Dict[str, int], seed: int) -> Dict[str, List[int]]:
    """``items`` shuffled by ``seed`` (Python's ``random.Random``), then the first ``sizes[s1]`` of
    them to ``s1``, the next ``sizes[s2]`` to ``s2``, ... (what is left over goes nowhere)."""
    order = list(items)
    random.Random(seed).shuffle(order)
    dealt, at = {}, 0
    for split, n in sizes.items():
        dealt[split] = order[at:at + n]
        at += n
    return dealt


def partition_rows(rows: Sequence[Dict[str, str]], sizes: Dict[str, int], take: Sequence[str],
                   seed: int) -> List[Dict[str, str]]:
    """``rows`` (dicts with a ``split`` key) with the rows of the ``take`` splits dealt out anew:
    shuffled by ``seed`` (Python's ``random.Random``), then the first ``sizes[s1]`` to ``s1``, the
    next ``sizes[s2]`` to ``s2``, ... Rows of other splits keep theirs; the order of the rows is kept."""
    picked = [i for i, r in enumerate(rows) if r["split"].strip() in take]
    if not picked:
        raise ValueError(f"no rows in the splits {', '.join(take)} to re-partition")
    if any(n < 0 for n in sizes.values()):
        raise ValueError(f"split sizes must be 0 or more, got {sizes}")
    moved = set(sizes) - set(take)
    kept = {r["split"].strip() for r in rows} - set(take)
    if moved & kept:
        raise ValueError(f"split(s) {', '.join(sorted(moved & kept))} are not re-partitioned (not in --from): "
                         f"new rows would join them")
    if sum(sizes.values()) != len(picked):
        raise ValueError(f"the sizes add up to {sum(sizes.values())}, but the splits {', '.join(take)} hold "
                         f"{len(picked)} rows: every one must be placed")
    out = [dict(r) for r in rows]
    for split, dealt in _deal(picked, sizes, seed).items():
        for i in dealt:
            out[i]["split"] = split
    return out


def partition_csv(labels: str, out: str, sizes: Dict[str, int], take: Sequence[str], seed: int) -> Dict[str, int]:
    """Read ``labels``, re-partition (:func:`partition_rows`), write ``out`` with paths relative to
    its folder; returns the rows per split of the new file."""
    src, dst = Path(labels), Path(out)
    with open(src, newline="") as f:
        reader = csv.DictReader(f)
        fields = [c.strip() for c in reader.fieldnames or []]
        reader.fieldnames = fields
        rows = list(reader)
    if "path" not in fields or "split" not in fields:
        raise ValueError(f"{src}: needs the columns path and split (found: {', '.join(fields) or 'none'})")
    new = partition_rows(rows, sizes, take, seed)
    base = src.resolve().parent
    dst.parent.mkdir(parents=True, exist_ok=True)
    for r in new:
        p = Path(r["path"])
        r["path"] = os.path.relpath(p if p.is_absolute() else base / p, dst.resolve().parent)
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(new)
    return dict(Counter(r["split"].strip() for r in new))


def partition_folder(root: str, out: str, sizes: Dict[str, int], seed: int, class_map: Optional[str] = None) -> Dict[str, int]:
    """Deal ``sizes`` images of the image folder ``root`` (``<class>/<image>``; labels as
    :class:`~timm_dora.data.ImageFolderDataset` gives them) into splits, shuffled by ``seed``
    (Python's ``random.Random``), and write them as a labels CSV at ``out`` (paths relative to its
    folder); the images not dealt are left out. Returns the rows per split."""
    from .data import ImageFolderDataset

    ds = ImageFolderDataset(root, class_map=class_map)
    if any(n < 0 for n in sizes.values()):
        raise ValueError(f"split sizes must be 0 or more, got {sizes}")
    if sum(sizes.values()) > len(ds):
        raise ValueError(f"the sizes add up to {sum(sizes.values())}, but {root} holds {len(ds)} images")
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    base = str(dst.resolve().parent)
    with open(dst, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "synset", "set", "split"])
        for split, dealt in _deal(range(len(ds)), sizes, seed).items():
            for i in dealt:
                p = ds.paths[i]
                w.writerow([os.path.relpath(p, base), ds.labels[i], os.path.basename(os.path.dirname(p)),
                            os.path.basename(ds.root), split])
    return dict(sizes)


def _size(text: str):
    name, eq, n = text.partition("=")
    if not eq or not name or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected split=count, e.g. rollout=400, got {text!r}")
    return name, int(n)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("partition", help="re-partition the training images of a labels CSV (test stays), or "
                              "draw splits from an image folder",
                              description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--labels", help="labels CSV (path,label,...,split) whose training rows are dealt anew")
    src.add_argument("--folder", help="an image folder <class>/<image> (e.g. ImageNet's train/) to draw the splits from")
    p.add_argument("--class-map", help="with --folder: the labels of its folders (classes.txt or a synset,label CSV)")
    p.add_argument("--sizes", type=_size, nargs="+", required=True, help="new splits in order, e.g. rollout=400 qc=300 dev=300")
    p.add_argument("--from", dest="take", nargs="+", default=["rollout", "qc", "dev"],
                   help="the splits whose rows are re-partitioned (every other row is kept as it is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the new labels CSV")
    p.set_defaults(func=_run)


def _run(args) -> int:
    sizes = dict(args.sizes)
    if len(sizes) != len(args.sizes):
        raise ValueError("--sizes names a split twice")
    if args.folder:
        counts = partition_folder(args.folder, args.out, sizes, args.seed, args.class_map)
    else:
        counts = partition_csv(args.labels, args.out, sizes, args.take, args.seed)
    print(f"{args.out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0
