"""Three inference-only studies of trained actors on the 1,000 ``sample1000`` pool images (not a test).

Each keeps an actor's own decisions of *where* and *how much* to prune and change one thing after
them, paired against native on the same images (fp32 on the CPU by default; ``test`` is never
read here, the pool is the training side of the data):

- ``selectors``: which tokens go. DORA's recorded gates and budgets with another token rule
  (App. F.1's substitution): ``cls_sim`` (the static baseline's rule: the visual tokens whose key
  is least cosine-similar to the CLS key go first), ``similarity`` (ToMe's metric) and ``random``.
- ``merge``: what happens to the removed tokens. ``delete`` is DORA (they are gone); ``merge_x``,
  ``merge_keys`` average each removed token into the surviving visual token of its image that is
  most cosine-similar to it (by the rows themselves, or by the block's keys: ToMe's metric),
  weighted by the number of patches each row already holds (its size); ``merge_keys_prop`` adds
  ToMe's proportional attention (``log(size)`` added to every key's logit). The actor was trained
  with deletion and sees the merged rows in later blocks. An exploratory extension, not an engine
  feature: it replaces the eager executor's deletion and the varlen attention in this process only
  (one image at a time, slow).
- ``fuse``: EViT's inattentive-token fusion instead of deletion: each image keeps one *fused* row,
  the size-weighted mean of every row the actor has removed so far (``fuse_prop``: with ToMe's
  proportional attention on it); it counts as a kept token in the engine's token counts and the
  GFLOPs.

    python -m benchmarks.pool_studies --model vit_tiny_patch16_224.augreg_in21k_ft_in1k \\
        --weights W.safetensors --data labels.csv --actors A1 A2 --out study.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

import timm_dora
from timm_dora.engine import blocks, eager, run
from timm_dora.evaluate import environment, load_model, loader_for
from timm_dora.evaluate.baselines.selectors import SELECTORS
from benchmarks.common import POOL, ClsSimSelector, command_line, paired

MERGE_MODES = ("delete", "merge_x", "merge_keys", "merge_keys_prop")
FUSE_MODES = ("delete", "fuse", "fuse_prop")


class Merging:
    """Replaces the eager executor's deletion (and the varlen attention, for ``prop``) so that
    removed rows are averaged into their most similar surviving visual row; ``sizes`` follows
    the rows (1 per patch at the start of each forward)."""

    def __init__(self, metric: str, prop: bool):
        self.metric, self.prop = metric, prop
        self.sizes: Optional[torch.Tensor] = None
        self.keys: Optional[torch.Tensor] = None
        self._delete, self._attention, self._attn_res = eager.delete_rows, blocks.varlen_attention, eager.attention_residual

    def __enter__(self):
        eager.delete_rows, eager.attention_residual = self.delete_rows, self.attention_residual
        if self.prop:
            blocks.varlen_attention = self.attention
        return self

    def __exit__(self, *exc):
        eager.delete_rows, blocks.varlen_attention, eager.attention_residual = self._delete, self._attention, self._attn_res

    def attention_residual(self, blk, packed, backend, *args, **kw):
        x, keys = self._attn_res(blk, packed, backend, *args, **kw)
        if self.sizes is None or self.sizes.shape[0] != packed.total:  # a new forward (all rows)
            self.sizes = torch.ones(packed.total, dtype=torch.float32, device=x.device)
        self.keys = keys
        return x, keys

    def attention(self, q, k, v, packed, scale, backend):
        out, cu = torch.empty_like(q), packed.cu_seqlens.tolist()
        for i in range(packed.batch_size):
            s, e = cu[i], cu[i + 1]
            qi, ki, vi = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
            bias = self.sizes[s:e].log().to(q.dtype)[None, None, None, :]
            out[s:e] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=bias, scale=scale)[0].transpose(0, 1)
        return out

    def delete_rows(self, packed, remove, removed, removed_host=None, out=None):
        x, seg, pos, size = packed.x, packed.seg, packed.pos, self.sizes
        metric = F.normalize((x if self.metric == "x" else self.keys).float(), dim=-1)
        merged, new_size = x.clone(), size.clone()
        for i in range(packed.batch_size):
            rows = (seg == i).nonzero().squeeze(1)
            gone = rows[remove[rows]]
            if gone.numel() == 0:
                continue
            kept = rows[~remove[rows] & (pos[rows] >= packed.num_prefix)]
            to = torch.searchsorted(kept, kept[(metric[gone] @ metric[kept].T).argmax(1)])
            acc, weight = x[kept].float() * size[kept, None], size[kept].clone()
            acc.index_add_(0, to, x[gone].float() * size[gone, None])
            weight.index_add_(0, to, size[gone])
            merged[kept], new_size[kept] = (acc / weight[:, None]).to(x.dtype), weight
        result = self._delete(packed.with_x(merged), remove, removed, removed_host, out)
        self.sizes = new_size[~remove]
        return result


class Fusion(Merging):
    """EViT's inattentive-token fusion as a substitution for deletion: each image keeps one *fused*
    row, the size-weighted mean of every row it has removed so far (the first removal revives one
    removed row to hold it; later removals are averaged into it, and if the actor removes the fused
    row itself it is averaged into the new one). So at most one row per image more than DORA's
    decisions keep; the revived row is taken off the decision's removal counts in place, so the
    engine's token counts (the actor's ``N_l`` from the next block on) and the GFLOPs statistics
    include it (the removal fraction ``rho`` the actor reads next is computed before, without it)."""

    def __init__(self, prop: bool):
        super().__init__("x", prop)
        self.fused: Optional[torch.Tensor] = None  # [T] bool: the fused row of its image
        self._exec_delete, self.n_visual = eager.EagerExecutor.delete, None

    def __enter__(self):
        fusion = self

        def delete(ex, l, dec, history=None):
            fusion.n_visual = history[0]  # the engine's per-image token count after this decision
            return fusion._exec_delete(ex, l, dec, history)
        eager.EagerExecutor.delete = delete
        return super().__enter__()

    def __exit__(self, *exc):
        eager.EagerExecutor.delete = self._exec_delete
        return super().__exit__(*exc)

    def attention_residual(self, blk, packed, backend, *args, **kw):
        x, keys = super().attention_residual(blk, packed, backend, *args, **kw)
        if self.fused is None or self.fused.shape[0] != packed.total:  # a new forward (all rows)
            self.fused = torch.zeros(packed.total, dtype=torch.bool, device=x.device)
        return x, keys

    def delete_rows(self, packed, remove, removed, removed_host=None, out=None):
        x, seg, size = packed.x, packed.seg, self.sizes
        fused_x, new_size, remove, fused = x.clone(), size.clone(), remove.clone(), self.fused.clone()
        for i in range(packed.batch_size):
            rows = (seg == i).nonzero().squeeze(1)
            gone = rows[remove[rows]]
            if gone.numel() == 0:
                continue
            own = rows[fused[rows]]
            target = own[0] if own.numel() else gone[0]
            group = torch.unique(torch.cat([gone, target[None]]))
            w = size[group]
            fused_x[target] = ((x[group].float() * w[:, None]).sum(0) / w.sum()).to(x.dtype)
            new_size[target], fused[target] = w.sum(), True
            if bool(remove[target]):  # revived: one removal fewer (in place: the engine's records)
                remove[target] = False
                removed[i] -= 1
                self.n_visual[i] += 1
        result = self._delete(packed.with_x(fused_x), remove, removed, None, out)
        self.sizes, self.fused = new_size[~remove], fused[~remove]
        return result


def _substitution(mode: str):
    """The context that replaces deletion for one ``merge`` or ``fuse`` mode (``delete``: none); a
    fresh one per batch, so sizes start at 1."""
    if mode == "delete":
        return contextlib.nullcontext()
    if mode.startswith("fuse"):
        return Fusion(mode == "fuse_prop")
    return Merging("x" if mode == "merge_x" else "keys", mode == "merge_keys_prop")


def study(model, actor: str, xs: List[torch.Tensor], native, labels, what: str) -> Dict[str, object]:
    timm_dora.wrap(model, actor, cuda_graphs=False)  # (outside inference mode: the actor's own tensors)
    with torch.inference_mode():
        preds, gflops = _forwards(model, xs, what)
    timm_dora.unwrap(model)
    return {name: {**paired(torch.cat(p), native, labels), "gflops": round(torch.cat(gflops[name]).mean().item(), 4)}
            for name, p in preds.items()}


def _forwards(model, xs: List[torch.Tensor], what: str):
    """Predictions and GFLOPs per row of the study, batch by batch."""
    preds: Dict[str, List[torch.Tensor]] = {}
    gflops: Dict[str, List[torch.Tensor]] = {}
    if what == "selectors":
        make = {"cls_sim": lambda st: ClsSimSelector.from_stats(st, model=model),
                "similarity": lambda st: SELECTORS["similarity"].from_stats(st, model=model),
                "random": lambda st: SELECTORS["random"].from_stats(st, model=model,
                                                                    generator=torch.Generator().manual_seed(0))}
        for x in xs:
            logits, st = run(model, x, timm_dora.policy_of(model))
            preds.setdefault("dora", []).append(logits.argmax(1))
            gflops.setdefault("dora", []).append(st.gflops.float())
            for name, selector in make.items():
                logits2, st2 = run(model, x, selector(st))
                preds.setdefault(name, []).append(logits2.argmax(1))
                gflops.setdefault(name, []).append(st2.gflops.float())
    else:
        for mode in FUSE_MODES if what == "fuse" else MERGE_MODES:
            for x in xs:
                with _substitution(mode):
                    logits, st = run(model, x, timm_dora.policy_of(model))
                preds.setdefault(mode, []).append(logits.argmax(1))
                gflops.setdefault(mode, []).append(st.gflops.float())
    return preds, gflops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--data", required=True, help="labels CSV with the rollout/qc/dev splits of sample1000")
    ap.add_argument("--actors", nargs="+", required=True)
    ap.add_argument("--studies", nargs="+", default=["selectors", "merge"], choices=["selectors", "merge", "fuse"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--img-size", type=int, default=None, help="(smoke tests: a small random backbone)")
    ap.add_argument("--num-classes", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.weights, img_size=args.img_size, num_classes=args.num_classes).eval()
    xs, ys = [], []
    for split in POOL:
        for x, y, *_ in loader_for(model, args.data, split, batch=50, workers=args.workers):
            xs.append(x)
            ys.append(y)
    labels = torch.cat(ys)
    with torch.inference_mode():
        native = torch.cat([model(x).argmax(1) for x in xs])
    res = {**environment(torch.device("cpu"), command_line("pool_studies", argv)),
           "model": args.model, "images": len(labels), "splits": list(POOL),
           "native_top1": round((native == labels).float().mean().item() * 100, 2), "actors": {}}
    for actor in args.actors:
        res["actors"][actor] = {what: study(model, actor, xs, native, labels, what) for what in args.studies}
        print(actor, json.dumps(res["actors"][actor]), flush=True)
    Path(args.out).write_text(json.dumps(res, separators=(",", ":")))
    return res


if __name__ == "__main__":
    main()
