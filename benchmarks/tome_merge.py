"""How much ToMe's rows depend on the arithmetic of its merge (not a test).

Our ToMe port (:mod:`timm_dora.evaluate.baselines.tome`), like the official code, sums each merged
group with ``scatter_add`` in the model's dtype; on CUDA its atomics add in whatever order they
happen to take, so in bf16 two identical runs can differ. The alternative measured here sums each
group in float32 in a fixed order (:func:`group_sums`: bit-identical runs). Per model and ``r``
(bf16 on CUDA): whether ``--runs`` forwards of one batch give bit-identical logits
(``identical_runs``, ``max_abs_diff``) with each form, how far the two forms' logits are apart
(``forms_max_abs_diff``), and the time per batch of each form (the protocol of
:func:`timm_dora.evaluate.bench.time_forward`: warm-up, median of repeats, same process; random
weights). With ``--accuracy-models MODEL=WEIGHTS`` and ``--data``, also each real backbone's top-1
drop against native with each form, twice, on the images of ``--splits`` (default: the 1,000 pool
images; ``test`` is not needed for this).

    python -m benchmarks.tome_merge --accuracy-models deit_tiny_patch16_224.fb_in1k=W1.safetensors \\
        vit_tiny_patch16_224.augreg_in21k_ft_in1k=W2.safetensors --data labels.csv \\
        --out benchmarks/results/tome_merge_h100.json
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Dict, List

import torch

from timm_dora.evaluate import environment, inference_device, load_model, loader_for, write_json
from timm_dora.evaluate.baselines import tome
from timm_dora.evaluate.bench import time_forward
from benchmarks.common import command_line

PORT = tome.bipartite_soft_matching


def group_sums(index: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    """``out[b, j] = sum of src[b, i] over i with index[b, i] == j`` (``[B, n, C]``, zeros where
    nothing goes) in a fixed order: rows sorted by target (stable), a running sum minus the running
    sum before each group, so each target receives one nonzero row (adding the zeros is exact).
    ``index``: ``[B, r]``; ``src``: ``[B, r, C]``."""
    order = index.argsort(dim=1, stable=True)
    idx = index.gather(1, order)
    run = src.gather(1, order[..., None].expand_as(src)).cumsum(1)
    pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    first = torch.ones_like(idx, dtype=torch.bool)
    first[:, 1:] = idx[:, 1:] != idx[:, :-1]
    last = torch.ones_like(idx, dtype=torch.bool)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(1).values  # each row's group start
    before = torch.cat([torch.zeros_like(run[:, :1]), run[:, :-1]], dim=1).gather(1, start[..., None].expand_as(run))
    total = torch.where(last[..., None], run - before, torch.zeros_like(run))  # a group's sum, at its last row
    out = torch.zeros(src.shape[0], n, src.shape[2], dtype=src.dtype, device=src.device)
    return out.scatter_add(1, idx[..., None].expand_as(total), total)


def fixed_order_merge(x, metric, size, r, num_prefix):
    """The port's matching (:func:`~timm_dora.evaluate.baselines.tome.bipartite_edges`), with each
    group's size-weighted average summed by :func:`group_sums` in float32 (the port: ``scatter_add``
    in the model's dtype)."""
    if r <= 0:
        return x, size
    p, (b, n, c) = num_prefix, x.shape
    src, dst, unm = tome.bipartite_edges(metric, r, p)
    xv, sv = x[:, p:], size[:, p:]
    xa, xb, sa, sb = xv[:, 0::2], xv[:, 1::2], sv[:, 0::2], sv[:, 1::2]
    s_src = sa.gather(1, src).float()
    rows = xa.gather(1, src[..., None].expand(b, r, c)).float() * s_src[..., None]
    sums = group_sums(dst, torch.cat([rows, s_src[..., None]], dim=-1), xb.shape[1])
    sb_new = sb.float() + sums[..., c]
    xb_new = ((xb.float() * sb.float()[..., None] + sums[..., :c]) / sb_new[..., None]).to(x.dtype)
    x_unm = xa.gather(1, unm[..., None].expand(b, xa.shape[1] - r, c))
    return (torch.cat([x[:, :p], x_unm, xb_new], dim=1),
            torch.cat([size[:, :p], sa.gather(1, unm), sb_new.to(size.dtype)], dim=1))


FORMS = {"scatter_add": PORT, "fixed_order_fp32": fixed_order_merge}


@contextlib.contextmanager
def merge_form(form: str):
    tome.bipartite_soft_matching = FORMS[form]
    try:
        yield
    finally:
        tome.bipartite_soft_matching = PORT


def accuracy(model, batches: List, r_values: List[int]) -> Dict[str, Any]:
    """Per ``r`` and form: the top-1 drop against native (pp), in two runs."""
    with torch.inference_mode():
        native = torch.cat([model(x).argmax(1) for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    base = (native == labels).double().mean()
    rows = []
    for r in r_values:
        row: Dict[str, Any] = {"r": r}
        for form in FORMS:
            drops = []
            with merge_form(form), torch.inference_mode():
                for _ in range(2):
                    pred = torch.cat([tome.tome_forward(model, x, r).argmax(1) for x, _ in batches])
                    drops.append(100.0 * float(base - (pred == labels).double().mean()))
            row[form] = drops
        rows.append(row)
        print(row, flush=True)
    return {"images": int(labels.numel()), "native_top1": 100.0 * float(base), "rows": rows}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["deit_tiny_patch16_224", "deit_base_patch16_224"])
    ap.add_argument("--r", type=int, nargs="+", default=[8, 13])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=20, help="forwards of one batch compared for bit-identical logits")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--accuracy-models", nargs="*", default=[], metavar="MODEL=WEIGHTS",
                    help="real backbones (their .safetensors) for the accuracy part")
    ap.add_argument("--data", default=None, help="labels CSV")
    ap.add_argument("--splits", nargs="+", default=["rollout", "qc", "dev"])
    ap.add_argument("--accuracy-r", type=int, nargs="+", default=list(range(4, 15)))
    ap.add_argument("--img-size", type=int, default=None, help="(smoke tests: a small model)")
    ap.add_argument("--num-classes", type=int, default=None, help="(smoke tests)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dtype, _ = inference_device(args.device)
    cmd = command_line("tome_merge", argv)
    res: Dict[str, Any] = {**environment(dev, cmd), "dtype": str(dtype).replace("torch.", ""), "rows": []}
    g = torch.Generator().manual_seed(0)
    for name in args.models:
        model = load_model(name, random_weights=True, img_size=args.img_size).to(dev, dtype).eval()
        size = model.patch_embed.img_size[0]
        x = torch.randn(args.batch, 3, size, size, generator=g).to(dev, dtype)
        for r in args.r:
            row: Dict[str, Any] = {"model": name, "r": r, "batch": args.batch}
            first = {}
            for form in FORMS:
                with merge_form(form), torch.inference_mode():
                    fn = lambda t: tome.tome_forward(model, t, r)  # noqa: E731
                    outs = [fn(x).float() for _ in range(args.runs)]
                    timing = time_forward(fn, x, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
                diff = max(float((o - outs[0]).abs().max()) for o in outs)
                first[form] = outs[0]
                row[form] = {"identical_runs": diff == 0.0, "max_abs_diff": diff,
                             "ms_per_batch": timing["ms_per_batch"], "images_per_s": timing["images_per_s"]}
            row["forms_max_abs_diff"] = float((first["fixed_order_fp32"] - first["scatter_add"]).abs().max())
            row["time_ratio"] = row["fixed_order_fp32"]["ms_per_batch"] / row["scatter_add"]["ms_per_batch"]
            res["rows"].append(row)
            print(row, flush=True)
    res["accuracy"] = []
    for spec in args.accuracy_models:
        name, weights = spec.split("=", 1)
        model = load_model(name, weights, img_size=args.img_size, num_classes=args.num_classes).to(dev, dtype).eval()
        batches = [(x.to(dev, dtype), y.to(dev)) for split in args.splits
                   for x, y, *_ in loader_for(model, args.data, split, batch=args.batch, workers=args.workers)]
        res["accuracy"].append({"model": name, "splits": args.splits, **accuracy(model, batches, args.accuracy_r)})
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
