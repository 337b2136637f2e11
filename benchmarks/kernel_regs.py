"""Registers and spills of the controller's row kernels, compiled for an H100 without one (CPU).

Triton compiles ``timm_dora.actor_kernels``' ``_embed_qkv``, ``_out_ffn`` and ``_scores`` for
``sm_90`` (no GPU needed: the compiler and ``cuobjdump`` ship with Triton) at each launch
configuration (rows per program, warps, the K block of ``_embed_qkv``, the FFN chunk of
``_out_ffn``, Triton's ``num_stages``) and ``cuobjdump -res-usage`` reads the registers per thread
(``REG``, at most 255) and the per-thread stack (``STACK``: registers spilled to local memory, each
read back from L1/L2 on the critical path). A diagnostic for choosing configurations to time on
the GPU with ``controller_kernels.py --tiles``, not a timing.

    python benchmarks/kernel_regs.py --out benchmarks/results/kernel_regs_sm90.json
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import timm_dora.actor_kernels as K  # noqa: E402
from timm_dora.evaluate import write_json  # noqa: E402

BF = "*bf16"
SIGNATURES = {
    "embed": dict(KEYS=BF, stride_k="i32", H="*fp32", CU="*i32", nseq="i32", steps="i32", WIN=BF, BIN=BF, EMB=BF,
                  WH=BF, G1=BF, B1=BF, WQKV=BF, BQKV=BF, X=BF, QKV=BF, REMOVE="*i1", total="i32", eps="fp32",
                  D="constexpr", W="constexpr", BLOCK_R="constexpr", BLOCK_K="constexpr", PREC="constexpr"),
    "out_ffn": dict(O=BF, X=BF, CU="*i32", nseq="i32", WP=BF, BP=BF, G2=BF, B2=BF, WF1=BF, BF1=BF, WF2=BF, BF2=BF,
                    Z=BF, eps="fp32", W="constexpr", F="constexpr", FCH="constexpr", BLOCK_R="constexpr",
                    PREC="constexpr"),
    "scores": dict(Z=BF, CU="*i32", nseq="i32", steps="i32", FRAC="*fp32", WK=BF, WS1=BF, BS1=BF, WS2=BF, BS2=BF,
                   SC="*fp32", W="constexpr", S="constexpr", NP="constexpr", BLOCK_R="constexpr", PREC="constexpr"),
}
KERNELS = {"embed": "_embed_qkv", "out_ffn": "_out_ffn", "scores": "_scores"}


def usage(kernel: str, constexprs: dict, warps: int, stages: int, arch: int) -> dict:
    fn = getattr(K, KERNELS[kernel])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = triton.compile(ASTSource(fn=fn, signature=SIGNATURES[kernel], constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), "shared_bytes": compiled.metadata.shared}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[192, 768], help="key widths d (ViT-Ti, DeiT-B)")
    ap.add_argument("--tiles", nargs="+", default=["128,8", "64,8", "64,4", "32,4"], help="rows per program,warps")
    ap.add_argument("--k-blocks", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--ffn-chunks", type=int, nargs="+", default=[128, 64, 32])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 1])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    w, f, s, np_ = 128, 256, 64, 256  # the paper's actor: width 128, FFN 256, selector 64; N0 = 196 -> 256
    rows = []
    for tile in args.tiles:
        block_r, warps = (int(x) for x in tile.split(","))
        for stages in args.stages:
            configs = [("out_ffn", dict(W=w, F=f, FCH=c, BLOCK_R=block_r, PREC="tf32"), dict(ffn_chunk=c))
                       for c in args.ffn_chunks]
            configs += [("scores", dict(W=w, S=s, NP=np_, BLOCK_R=block_r, PREC="tf32"), {})]
            configs += [("embed", dict(D=d, W=w, BLOCK_R=block_r, BLOCK_K=kb, PREC="tf32"), dict(d=d, k_block=kb))
                        for d in args.widths for kb in args.k_blocks if kb <= d]
            for kernel, constexprs, extra in configs:
                row = {"kernel": KERNELS[kernel], "rows_per_program": block_r, "warps": warps, "num_stages": stages,
                       **extra, **usage(kernel, constexprs, warps, stages, args.arch)}
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    result = {"command": "python benchmarks/kernel_regs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "triton": triton.__version__, "arch": f"sm_{args.arch}", "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
