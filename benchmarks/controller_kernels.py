"""The actor's controller: ``nn`` modules against the fused Triton kernels (not a test; CUDA).

``ActorPolicy.controller_fixed`` as the CUDA graphs run it where a gate opened: every image of a
batch of 320 (bf16), a packed layout of CLS + visual keys per image with the mean token count
+- ``--spread``, the gate open on every image. Per backbone key width (ViT-Ti 192, DeiT-B 768) and
mean length: the GPU time of the module path (``fused_controller=False``) and of
:mod:`timm_dora.actor_kernels` for each ``--tiles`` configuration (rows per program, warps),
each the median over ``--repeats`` CUDA-event measurements of ``--iters`` calls replayed from one
CUDA graph (as in ``attention_kernels.py``); the kernels launched per call (torch profiler, one
eager call); and how often the two paths agree in bf16 (budgets per image, removal flags of
the tokens of images with the same budget).

    python benchmarks/controller_kernels.py --out benchmarks/results/controller_kernels_h100.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_kernels import cuda_time_us, ragged_lengths  # noqa: E402

from timm_dora import Actor, ActorPolicy  # noqa: E402
from timm_dora.actor_kernels import ROW_LAUNCH, TILE_ROWS, fused_controller  # noqa: E402
from timm_dora.evaluate import environment, write_json  # noqa: E402


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def parse_tile(spec: str):
    """``"R,W"`` -> ``(R, W)`` for every row kernel; ``"embed=R,W/out_ffn=R,W"`` -> a dict per kernel."""
    if "=" not in spec:
        return tuple(int(x) for x in spec.split(","))
    out = {}
    for part in spec.split("/"):
        name, rw = part.split("=")
        if name not in TILE_ROWS:
            raise SystemExit(f"--tiles: unknown kernel {name!r} ({', '.join(TILE_ROWS)})")
        out[name] = tuple(int(x) for x in rw.split(","))
    return out


def tile_name(tile) -> str:
    if isinstance(tile, dict):
        return "/".join(f"{k}={v[0]},{v[1]}" for k, v in tile.items())
    return ",".join(map(str, tile))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768])
    ap.add_argument("--means", type=int, nargs="+", default=[197, 142, 90])
    ap.add_argument("--spread", type=int, default=16)
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--tiles", nargs="+", default=["embed=64,8/out_ffn=128,8/scores=128,8", "128,8", "64,8", "64,4"],
                    help="rows per program,warps of the row-wise kernels: R,W for all three, or per kernel "
                         "embed=R,W/out_ffn=R,W/scores=R,W (the missing ones at the default)")
    ap.add_argument("--ffn-chunk", type=int, default=None,
                    help="the FFN's hidden units per step in _out_ffn (actor_kernels.ROW_LAUNCH['ffn_chunk'])")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, dt, n0, seq = "cuda", torch.bfloat16, 196, 197
    gen = torch.Generator().manual_seed(0)
    tiles = [parse_tile(t) for t in args.tiles]
    if args.ffn_chunk is not None:
        ROW_LAUNCH["ffn_chunk"] = args.ffn_chunk
    rows = []
    for d in args.widths:
        torch.manual_seed(0)
        actor = Actor(d, 12, n0).to(dev, dt).eval()
        with torch.no_grad():  # trained-like spread of budgets and scores (not all at the init's values)
            for prm in actor.parameters():
                prm.add_(0.2 * torch.randn_like(prm))
        for mean in args.means:
            b = args.batch
            lengths, cu = ragged_lengths(b, mean, args.spread, seq, 6, gen, dev)
            t = int(lengths.sum())
            keys = torch.randn(t + 128, d, device=dev, dtype=dt)
            n_visual = (lengths - 1).to(dev)
            h = torch.stack([n_visual / n0, torch.rand(b, device=dev), torch.zeros(b, device=dev)], 1)
            gate = torch.ones(b, dtype=torch.bool, device=dev)
            row = {"key_width": d, "mean_tokens": mean, "total_rows": t}
            with torch.inference_mode():
                modules = ActorPolicy(actor, fused_controller=False)
                fused = ActorPolicy(actor, fused_controller=True)
                call_m = lambda: modules.controller_fixed(keys, cu, seq, 1, h, n_visual, gate, 4, "triton")  # noqa: E731
                call_f = lambda: fused.controller_fixed(keys, cu, seq, 1, h, n_visual, gate, 4, "triton")  # noqa: E731
                rm, km, _ = call_m()
                rf, kf, _ = call_f()
                same_k = km == kf
                tok_same = same_k[torch.repeat_interleave(torch.arange(b, device=dev), lengths.to(dev))]
                row["budget_agreement"] = float(same_k.float().mean())
                row["removal_agreement_same_budget"] = float((rm[:t] == rf[:t])[tok_same].float().mean())
                row["modules_us"] = cuda_time_us(call_m, args.iters, args.repeats)
                row["modules_kernels"] = kernels_per_call(call_m)
                row["fused_kernels"] = kernels_per_call(call_f)
                row["fused_us"] = {}
                for tile in tiles:
                    fn = lambda: fused_controller(actor, keys, cu, seq, h, n_visual,  # noqa: E731
                                                  gate, 4, cu, 1, t + 128, tile=tile)
                    row["fused_us"][tile_name(tile)] = cuda_time_us(fn, args.iters, args.repeats)
                row["fused_default_tile"] = tile_name(TILE_ROWS)
                row["fused_policy_us"] = cuda_time_us(call_f, args.iters, args.repeats)  # with the index math
            best = min(row["fused_us"], key=row["fused_us"].get)
            row["fused_best"] = best
            print(f"d={d:4d} mean={mean:3d} rows={t}: modules {row['modules_us']:7.1f} us ({row['modules_kernels']} kernels), "
                  f"fused {row['fused_policy_us']:7.1f} us ({row['fused_kernels']} kernels; kernels alone best {best} "
                  f"{row['fused_us'][best]:6.1f}, default {row['fused_us'].get(row['fused_default_tile'], float('nan')):6.1f}); agreement "
                  f"budgets {row['budget_agreement']:.3f} removals {row['removal_agreement_same_budget']:.4f}", flush=True)
            rows.append(row)
    result = {**environment(torch.device(dev), "python benchmarks/controller_kernels.py " + " ".join(argv or sys.argv[1:])),
              "batch": args.batch, "dtype": "bfloat16", "row_launch": dict(ROW_LAUNCH), "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
