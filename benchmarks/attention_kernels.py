"""Variable-length attention kernels on pruned-block shapes (not a test; CUDA).

Batch 320, head dim 64, bf16, ``q, k, v`` as the views of one fused ``qkv`` projection (``[T, 3, H,
hd]``, as in a wrapped block). Per backbone width (ViT-Ti 3 heads, ViT-S 6, DeiT-B 12) and mean
tokens per image (197 = unpruned, then mean +- ``--spread``): the FlashAttention-2 varlen kernel of
the ``torch_varlen`` backend (``aten::_flash_attention_forward``), this package's Triton kernel
(``timm_dora.engine.varlen_kernel``) for each ``--tiles`` configuration, and dense SDPA (timm's own path,
cuDNN on an H100) on a uniform batch with the same row count (the oracle's kernel). Each time is the
median over ``--repeats`` CUDA-event measurements of ``--iters`` calls replayed from one CUDA
graph (GPU time only: the wrapped forward replays its attention from graphs too). Also per
shape: the largest difference of the Triton output from FlashAttention's, and whether a captured
CUDA graph of the Triton call gives the right result after ``cu_seqlens`` changed in place.

    python -m benchmarks.attention_kernels --out benchmarks/results/attention_kernels_h100.json
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from timm_dora.evaluate import environment, write_json
from timm_dora.engine.varlen_kernel import TILE, varlen_attention_triton


def cuda_time_us(fn, iters: int, repeats: int) -> float:
    """GPU time per call: ``iters`` calls captured as one CUDA graph (no host launch cost in the
    measurement: a Triton launch costs more host time than a small kernel's GPU time), replayed
    ``repeats`` times between CUDA events; the median."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters * 1000)
    return statistics.median(times)


def ragged_lengths(batch: int, mean: int, spread: int, seq: int, min_len: int, gen: torch.Generator, device):
    """Per-image token counts of a ragged batch and their int32 ``cu_seqlens`` on ``device``: all
    ``seq`` when ``mean >= seq``, else ``mean`` plus a uniform integer in ``[-spread, spread]``
    (drawn from ``gen``), clamped to ``[min_len, seq]``."""
    if mean >= seq:
        lengths = torch.full((batch,), seq)
    else:
        lengths = (mean + torch.randint(-spread, spread + 1, (batch,), generator=gen)).clamp(min_len, seq)
    return lengths, F.pad(lengths.cumsum(0), (1, 0)).to(device, torch.int32)


def flash(q, k, v, cu, n, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, False, False, scale=scale)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[3, 6, 12])
    ap.add_argument("--means", type=int, nargs="+", default=[197, 142, 90, 50])
    ap.add_argument("--spread", type=int, default=16)
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--tiles", nargs="+", default=["64,64,4,2", "64,64,4,3", "64,64,4,4", "128,64,4,2", "128,64,8,2",
                                                    "128,64,8,3", "64,32,4,2", "64,32,2,2", "32,32,2,2",
                                                    "32,64,4,2", "64,128,4,2", "128,128,8,2"],
                    help="BLOCK_M,BLOCK_N,warps,stages configurations of the Triton kernel")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dt, hd, seq = "cuda", torch.bfloat16, 64, 197
    gen = torch.Generator().manual_seed(0)
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    rows = []
    for h in args.heads:
        for mean in args.means:
            b = args.batch
            lengths, cu = ragged_lengths(b, mean, args.spread, seq, 2, gen, dev)
            t = int(lengths.sum())
            qkv = torch.randn(t + 64, 3, h, hd, device=dev, dtype=dt)  # 64 padded rows, never read
            q, k, v = qkv.unbind(1)
            scale = hd ** -0.5
            row = {"heads": h, "mean_tokens": mean, "total_rows": t, "max_len": int(lengths.max())}
            ref = flash(q, k, v, cu, seq, scale)[:t]
            row["flash_varlen_us"] = cuda_time_us(lambda: flash(q, k, v, cu, seq, scale), args.iters, args.repeats)
            m = round(t / b)
            qd, kd, vd = (torch.randn(b, h, m, hd, device=dev, dtype=dt) for _ in range(3))
            row["dense_sdpa_same_rows_us"] = cuda_time_us(lambda: F.scaled_dot_product_attention(qd, kd, vd),
                                                          args.iters, args.repeats)
            row["triton_us"] = {}
            for tile in tiles:
                fn = lambda: varlen_attention_triton(q, k, v, cu, seq, scale, tile=tile)  # noqa: E731
                out = fn()[:t]
                key = ",".join(map(str, tile))
                row["triton_us"][key] = cuda_time_us(fn, args.iters, args.repeats)
                row.setdefault("triton_max_abs_diff", {})[key] = float((out.float() - ref.float()).abs().max())
            best = min(row["triton_us"], key=row["triton_us"].get)
            row["triton_best"] = best
            row["triton_default"] = ",".join(map(str, TILE[hd]))
            # graph capture with the default tiles, then new lengths written into the same cu_seqlens
            cu_buf = cu.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                varlen_attention_triton(q, k, v, cu_buf, seq, scale)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                captured = varlen_attention_triton(q, k, v, cu_buf, seq, scale)
            flipped = F.pad(lengths.flip(0).cumsum(0), (1, 0)).to(dev, torch.int32)
            cu_buf.copy_(flipped)
            g.replay()
            torch.cuda.synchronize()
            ref2 = flash(q, k, v, cu_buf, seq, scale)[:t]
            row["graph_new_lengths_max_abs_diff"] = float((captured[:t].float() - ref2.float()).abs().max())
            print(f"H={h:2d} mean={mean:3d}: flash {row['flash_varlen_us']:7.1f} us, dense sdpa "
                  f"{row['dense_sdpa_same_rows_us']:7.1f} us, triton best {best} "
                  f"{row['triton_us'][best]:7.1f} us, default {row['triton_us'][row['triton_default']]:7.1f} us; "
                  f"max diff {max(row['triton_max_abs_diff'].values()):.4f}, graph {row['graph_new_lengths_max_abs_diff']:.4f}",
                  flush=True)
            rows.append(row)
    result = {**environment(torch.device(dev)), "batch": args.batch,
              "head_dim": hd, "dtype": "bfloat16", "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
