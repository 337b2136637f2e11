"""Launch settings of the engine's small dense kernels at the row counts of batches 1-16 (not a test).

Each variant runs ``--calls`` times back to back inside one CUDA graph (a small request is a chain of
such graph nodes); the time per call is the graph's replay time over the calls, the median of
``--repeats`` replays. Read: the residual sum with the LayerNorm (``dense_kernels._add_layer_norm_fwd``)
per rows-per-program and warps, beside ``torch.compile``'s kernel for ``layer_norm(x + d)`` (which
does not write the sum: a quarter fewer bytes); with ``--fold``, merging's fold
(:func:`timm_dora.engine.fold_kernel.fold_rows`, DeiT-Ti's shape: 3 heads of 64, ``--removed`` (a third) of each
image's visual rows removed) per tile of its match, each checked equal to the default's result, and
``EngineOptions.fold_aside``'s halves: the similarities (``similarities_us``, beside the decision) and
the fold that picks its matches from them (``picked_us``, after it); with ``--attention``, the varlen
attention kernel without and with merged rows' sizes per tile (DeiT-Ti's shape); with ``--gelu``, an
``Mlp``'s first layer and GELU as one kernel per tile, against ATen's two.

    python -m benchmarks.small_kernels --out small_kernels.json
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton

from timm_dora.engine import dense_kernels as dk
from benchmarks.common import command_line, graph_call_us
from timm_dora.evaluate import environment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768])
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 320])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--fold", action="store_true", help="sweep the fold's match tiles instead")
    ap.add_argument("--removed", type=float, default=1 / 3, help="(--fold) the share of visual rows removed")
    ap.add_argument("--in-effect", action="store_true", help="(--fold) only the match tile in effect")
    ap.add_argument("--gelu", action="store_true",
                    help="the MLP's first layer and GELU in one kernel per tile, against F.linear then nn.GELU")
    ap.add_argument("--attention", action="store_true",
                    help="the varlen attention kernel with and without merged rows' sizes, per tile, instead")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res = {**environment(dev, command_line("small_kernels"))}
    if args.fold:
        return fold_sweep(args, res, dev, dtype)
    if args.attention:
        return attention_sweep(args, res, dev, dtype)
    if args.gelu:
        return gelu_sweep(args, res, dev, dtype)
    res["add_layer_norm"] = []
    for d in args.widths:
        w, b = torch.randn(d, device=dev, dtype=dtype), torch.randn(d, device=dev, dtype=dtype)
        block_n = triton.next_power_of_2(d)
        for n in args.images:
            rows = n * 197
            x, br = torch.randn(rows, d, device=dev, dtype=dtype), torch.randn(rows, d, device=dev, dtype=dtype)
            s, y = torch.empty_like(x), torch.empty_like(x)
            row = {"d": d, "images": n, "rows": rows, "in_effect": dk._ln_config(block_n)}
            compiled = torch.compile(lambda x, br: F.layer_norm(x + br, (d,), w, b, 1e-6), dynamic=False)
            row["inductor_us"] = round(graph_call_us(lambda: compiled(x, br), args.calls, args.repeats), 3)
            configs = {}
            for per in (1, 2, 4, 8, 16, 32):
                if per * block_n > 16384:
                    continue
                for warps in (1, 2, 4, 8):
                    def run(per=per, warps=warps):
                        dk._add_layer_norm_fwd[(triton.cdiv(rows, per),)](
                            x, br, s, w, b, y, rows, d, d, d, d, d, 1e-6, BLOCK_N=block_n, ROWS=per, num_warps=warps)
                    configs[f"{per}x{warps}"] = round(graph_call_us(run, args.calls, args.repeats), 3)
            row["triton_us"] = configs
            row["best"] = min(configs, key=configs.get)
            res["add_layer_norm"].append(row)
            print("add_layer_norm", d, n, row["inductor_us"], row["best"], configs[row["best"]],
                  "in effect", row["in_effect"], configs.get("%dx%d" % row["in_effect"]), flush=True)
            json.dump(res, open(args.out, "w"), indent=1)


def fold_sweep(args, res, dev, dtype) -> None:
    """The fold per match tile (removed rows, key rows, warps) at ``--images`` images of 197 rows."""
    from timm_dora.engine.fold_kernel import fold_rows, fold_similarities, match_tile_for
    res["fold"] = []
    d, heads, n = 192, 3, 197
    for b in args.images:
        torch.manual_seed(0)
        t = b * n
        cu = torch.arange(0, t + 1, n, device=dev, dtype=torch.int32)
        x, keys = torch.randn(t, d, device=dev, dtype=dtype), torch.randn(t, d, device=dev, dtype=dtype)
        remove = (torch.rand(t, device=dev) < args.removed) & (torch.arange(t, device=dev) % n != 0)
        sizes = 1 + torch.rand(t, device=dev)
        scratch = (torch.zeros(t, d, device=dev), torch.zeros(t, device=dev))
        out, sizes_out = torch.empty_like(x), torch.empty_like(sizes)

        def run(tile=None):
            return fold_rows(x, keys, remove, sizes, cu, n, 1, heads, out=out, sizes_out=sizes_out, scratch=scratch,
                             match_tile=tile)
        ref = [r.clone() for r in run()]
        row = {"images": b, "rows": t, "in_effect": list(match_tile_for(b, n)), "us": {}}
        tiles = [match_tile_for(b, n)] if args.in_effect else [(bm, bn, warps) for bm in (16, 32, 64)
                                                                  for bn in (32, 64, 128) for warps in (2, 4, 8)]
        for tile in tiles:
            got = run(tile)
            same = all(torch.equal(a, c) for a, c in zip(got, ref))
            row["us"]["%dx%dx%d" % tile] = {"us": round(graph_call_us(lambda: run(tile), args.calls, args.repeats), 3),
                                            "same": same}
        # EngineOptions.fold_aside: the similarities (beside the decision) and the fold that picks from them
        sim = fold_similarities(keys, cu, n, heads)  # (at 320 images 64 MB; the engine makes none above 8,192 rows)
        picked = fold_rows(x, keys, remove, sizes, cu, n, 1, heads, out=out, sizes_out=sizes_out, scratch=scratch,
                           similarities=sim)
        row["similarities_us"] = round(graph_call_us(lambda: fold_similarities(keys, cu, n, heads, out=sim),
                                                     args.calls, args.repeats), 3)
        row["picked_us"] = round(graph_call_us(lambda: fold_rows(x, keys, remove, sizes, cu, n, 1, heads, out=out,
                                                                 sizes_out=sizes_out, scratch=scratch,
                                                                 similarities=sim), args.calls, args.repeats), 3)
        # (float32 atomics sum the received sizes in any order: equal up to rounding)
        row["picked_sizes_max_diff"] = float((picked[1] - ref[1]).abs().max())
        # the fold after the decision and the fused deletion, with the fold's own finish or with the
        # finish inside the deletion's gather (EngineOptions.fold_in_gather)
        from timm_dora.engine.deletion_kernel import delete_rows_fused
        removed = torch.stack([remove[i * n:(i + 1) * n].sum() for i in range(b)])
        ids, ids_out, rows_out = torch.arange(t, device=dev), torch.empty(t, dtype=torch.long, device=dev), torch.empty_like(x)
        lengths_out = torch.empty(b, dtype=torch.long, device=dev)
        xs, s_in, cu_out = x.clone(), sizes.clone(), cu.clone()

        def fold_and_delete(in_gather):
            xs.copy_(x), s_in.copy_(sizes), cu_out.copy_(cu)  # (the fold and the deletion work in place)
            fold_rows(xs, keys, remove, s_in, cu, n, 1, heads, out=xs, sizes_out=s_in, scratch=scratch,
                      similarities=sim if t <= 8192 else None, finish=not in_gather)
            delete_rows_fused(xs, remove, rows_out, ids, ids_out, cu_out, removed, lengths_out, cu_out, s_in,
                              received=scratch if in_gather else None)
        copies = graph_call_us(lambda: (xs.copy_(x), s_in.copy_(sizes), cu_out.copy_(cu)), args.calls, args.repeats)
        row["fold_and_deletion_us"] = {
            key: round(graph_call_us(lambda: fold_and_delete(on), args.calls, args.repeats) - copies, 3)
            for key, on in (("finish_then_gather", False), ("finish_in_gather", True))}
        timed = {k: v["us"] for k, v in row["us"].items()}
        row["best"] = min(timed, key=timed.get)
        res["fold"].append(row)
        print("fold", b, "best", row["best"], timed[row["best"]], "in effect", row["in_effect"],
              timed["%dx%dx%d" % tuple(row["in_effect"])], "similarities", row["similarities_us"], "picked",
              row["picked_us"], "fold and deletion", row["fold_and_deletion_us"], flush=True)
        json.dump(res, open(args.out, "w"), indent=1)


def attention_sweep(args, res, dev, dtype) -> None:
    """The varlen attention kernel at DeiT-Ti's shape (3 heads of 64, q/k/v views of one qkv output)
    on ``--images`` images of 140-197 rows, without and with merged rows' sizes, per (query rows,
    key rows, warps, stages). (The sizes' other forms, e.g. their logarithms added to the logits,
    were timed by this sweep's form in git history: ``benchmarks/results/attention_sizes_h200.json.gz``.)"""
    from timm_dora.engine.varlen_kernel import TILE, _varlen_fwd
    res["attention"] = []
    heads, hd, n = 3, 64, 197
    for b in args.images:
        g = torch.Generator().manual_seed(b)
        lengths = torch.randint(140, n + 1, (b,), generator=g)
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        t = int(cu[-1])
        cu = cu.to(dev)
        qkv = torch.randn(t, 3, heads, hd, device=dev, dtype=dtype)
        q, k, v = qkv.unbind(1)
        sizes = torch.randint(1, 6, (t,), generator=g).float().to(dev)
        out = torch.empty(t, heads, hd, device=dev, dtype=dtype)
        scale = hd ** -0.5 * 1.4426950408889634

        def run(tile, with_sizes):
            bm, bn, warps, stages = tile
            _varlen_fwd[(-(-n // bm), heads, b)](q, k, v, out, cu, sizes, q.stride(0), q.stride(1), k.stride(0),
                                                 k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                                                 scale, HEAD_DIM=hd, BLOCK_M=bm, BLOCK_N=bn, HAS_SIZES=with_sizes,
                                                 num_warps=warps, num_stages=stages)
        row = {"images": b, "rows": t, "in_effect": list(TILE[hd]), "us": {}}
        for mode in ("plain", "sizes"):
            for bm in (32, 64):
                for bn in (32, 64):
                    tile = (bm, bn, 4, 3)
                    key = "%s %dx%dx%dx%d" % ((mode,) + tile)
                    row["us"][key] = round(graph_call_us(lambda: run(tile, mode == "sizes"), args.calls,
                                                         args.repeats), 3)
            mine = {k: v for k, v in row["us"].items() if k.startswith(mode + " ")}
            best = min(mine, key=mine.get)
            row["best_" + mode] = [best, mine[best]]
            row["default_" + mode] = mine["%s %dx%dx%dx%d" % ((mode,) + TILE[hd])]
        res["attention"].append(row)
        print("attention", b, {k: row[k] for k in row if k.startswith(("best", "default"))}, flush=True)
        json.dump(res, open(args.out, "w"), indent=1)


def gelu_sweep(args, res, dev, dtype) -> None:
    """``gelu(x @ W^T + b)`` (an ``Mlp``'s ``fc1`` and exact GELU) at ``--images`` images of 197 rows
    for widths 192 -> 768 (Tiny) and 768 -> 3072 (Base): ATen (cuBLAS, then the GELU kernel) against
    :func:`timm_dora.engine.mlp_kernel.linear_gelu` per tile (rows, columns, k block, warps, stages,
    grouped row tiles), each checked against ATen's values."""
    import torch.nn.functional as F
    from timm_dora.engine.mlp_kernel import linear_gelu, tile_for
    tiles = [(128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8), (128, 64, 64, 4, 3, 8), (64, 128, 64, 4, 3, 8),
             (64, 64, 64, 4, 3, 8), (32, 64, 64, 4, 2, 8), (16, 64, 64, 4, 2, 8), (16, 128, 64, 4, 2, 8), (32, 128, 64, 4, 3, 8),
             (64, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (64, 128, 32, 4, 4, 8), (32, 64, 64, 4, 3, 8),
             (16, 64, 64, 2, 3, 8), (32, 32, 64, 2, 3, 8), (64, 64, 32, 4, 4, 8)]
    res["gelu"] = []
    for d in args.widths:
        for b in args.images:
            rows = b * 197
            x = torch.randn(rows, d, device=dev, dtype=dtype)
            w = torch.randn(4 * d, d, device=dev, dtype=dtype) / d ** 0.5
            bias = torch.randn(4 * d, device=dev, dtype=dtype)
            ref = F.gelu(F.linear(x, w, bias))
            row = {"d": d, "hidden": 4 * d, "images": b, "rows": rows, "in_effect": list(tile_for(rows)),
                   "aten_us": round(graph_call_us(lambda: F.gelu(F.linear(x, w, bias)), args.calls, args.repeats), 3),
                   "us": {}, "max_abs_diff": {}}
            for tile in tiles:
                key = "x".join(map(str, tile))
                row["max_abs_diff"][key] = float((linear_gelu(x, w, bias, tile=tile).float() - ref.float()).abs().max())
                row["us"][key] = round(graph_call_us(lambda: linear_gelu(x, w, bias, tile=tile), args.calls,
                                                     args.repeats), 3)
            row["best"] = min(row["us"], key=row["us"].get)
            res["gelu"].append(row)
            print("gelu", d, b, "aten", row["aten_us"], "best", row["best"], row["us"][row["best"]], flush=True)
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
