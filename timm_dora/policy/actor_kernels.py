"""The actor's deterministic gate and controller as Triton kernels (inference).

**Gate** (:func:`fused_gate`): ``W2 SiLU(W1_K K_CLS + c_l) + b2 >= 0`` and the feasibility rule, one
kernel per block instead of about ten (``c_l``: the first layer's context part,
:meth:`timm_dora.policy.actor.Actor.gate_bias`, computed once per history). Inside a CUDA graph the
small kernels of the module path each waited for a whole backbone kernel on the other stream (the
persistent GEMMs hold every SM), so the gate vector reached the host only at the end of the
block's graph, and the GPU idled while the host decided (measured on an H100; git history keeps the runs).

**Controller** (:func:`fused_controller`): where a gate opens, the controller (``W_in`` and the
shared encoder block, the budget head, the selector, the ``k`` highest scores) runs over every
token of the gate-active images. Written with ``torch.nn`` modules it is about 90 kernels per
intervention, each a few microseconds on an H100 over ``[T, 128]`` activations: latency- and
memory-bound, not arithmetic. Here it is six kernels (five with few rows), each reading its rows
once and keeping everything between two matrix products in registers:

1. ``_embed_qkv``: ``X = W_in K + b_in + e^C_l (+ W_h h_l on CLS rows)``, ``LayerNorm``, ``qkv``
   (it also clears the removal flags);
2. the encoder's attention: :func:`timm_dora.engine.varlen_kernel.varlen_attention_triton`;
3. ``_out_ffn``: output projection and residual, ``LayerNorm``, the GELU FFN and its residual
   (``Z_l``); with few rows a program (:data:`BUDGET_IN_FFN_ROWS`), those that hold a CLS row also
   run 4 on it (:func:`_budget_head`), one launch fewer on the decision's chain;
4. ``_budget`` (above :data:`BUDGET_IN_FFN_ROWS` rows a program of 3): the budget head on ``Z_CLS`` (``LayerNorm``, ``128 -> 128 -> M``), the infeasible
   budgets masked, the arg-max (ties to the smaller budget, as ``torch.argmax``) and ``k``
   (zero where the gate is closed), and the actor's FLOPs per image;
5. ``_scores``: the selector ``MLP_S(Z_j + W_k k/N_l)`` on every visual row, into a padded
   ``[B, NP]`` score matrix;
6. ``_select``: each visual token's rank in its image (higher score first, ties to the lower
   index: the order of a stable descending sort, as :func:`timm_dora.policy.actor.ordered_topk`),
   and the removal flag ``rank < k`` at the token's row of the block's layout.

(4-6 as one kernel with a program per image, for few images, was 11 us slower per deletion at
batches 1-16 inside a CUDA graph than the three: its serial work outweighs two launches; one H200,
``benchmarks/results/controller_launch_h200.json``. Git history keeps it.)

Each module's output is rounded to the activations' dtype where the ``nn`` modules round it (the
linear layers' and the residual sums' outputs), so in bf16 the decisions equal the module
path's up to the order of the fp32 sums (near-ties may go the other way, as between any two
kernels).

No shape depends on the sequence lengths and no value is read on the host: the call is captured
in the controller's CUDA graph (:mod:`timm_dora.engine.graphs`) and replayed with new lengths. Rows past
``cu_seqlens[-1]`` are neither read nor written (except the removal mask's, which stay
``False``). Off CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the CPU tests compare them with the module path.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .actor_flops import actor_gate_macs, controller_macs_terms
from ..engine.varlen_kernel import TILE, triton, varlen_attention_triton

__all__ = ["fused_gate", "fused_gate_context", "fused_controller", "fused_controller_reason", "TILE_ROWS", "GATE_LAUNCH",
           "ROW_LAUNCH"]

if triton is not None:
    import triton.language as tl

# rows per program of each row-wise kernel and its warps, fixed (no autotuning inside a capture):
# 128 rows, 8 warps the fastest of five tiles for all three together on an H100 at every shape of
# a sweep (10-14 % faster than 64 rows, 4 warps); then, per kernel, _embed_qkv at 64 rows, where it spills no registers, 4-15 us faster at every shape, while
# _out_ffn at 64 rows was 25-45 us slower. (The sweep and register-count scripts and their results
# left the tree with issue #31; git history keeps them.)
TILE_ROWS = {"embed": (64, 8), "out_ffn": (128, 8), "scores": (128, 8)}
# the other launch parameters (Triton's num_stages; the K loop's block over the key width; the FFN's
# hidden units per step): module constants so that benchmarks can sweep them
# gate: 16 images per program, the key width in blocks of 256 (64 below that width), no software
# pipelining: DeiT-B's d=768 17.5 -> 6.0 us, ViT-Ti's 192 3.6 -> 3.2 us at batch 320 (H100; the
# fastest of 72 configurations; the sweep is in git history)
# (at batches 1-16, one program: these are still the fastest of 18 configurations, 3.0 us at d=192
# and 5.7-5.9 us at d=768 on an H200; benchmarks/results/gate_launch_h200.json)
GATE_LAUNCH = dict(images=16, k_block=256, num_warps=4, num_stages=1)
# few rows (the planned whole graph at batches 1-16: 197 to 3,152 rows): a row kernel's grid of
# 128-row tiles is 2 to 25 programs, each a long serial chain on one SM (DeiT-B's width-128 actor:
# _out_ffn 31 us and _embed_qkv 14 us at one image, H200). Below the rows that fill SMALL_GRID
# programs the tile halves, down to 16 rows (tl.dot's least), at 4 warps: more programs, each shorter.
SMALL_GRID = 64
# at most this many rows a program of _out_ffn (few rows: the planned graph's small batches), the
# programs that hold a CLS row also run the budget head (_budget_head), one launch fewer on the
# decision's chain; with larger tiles nearly every program holds one, so _budget runs apart
BUDGET_IN_FFN_ROWS = 32
ROW_LAUNCH = dict(num_stages=3, k_block=64, ffn_chunk=128)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def fused_controller_reason(actor, dtype: torch.dtype, gate_only: bool = False) -> "str | None":
    """Why :func:`fused_controller` (or, ``gate_only``, :func:`fused_gate`) cannot run this actor
    (``None``: it can)."""
    if triton is None:
        return "the triton package is not installed"
    enc = actor.encoder
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not supported"
    if not _pow2(actor.gate_hidden):
        return f"actor gate_hidden={actor.gate_hidden} is not a power of two >= 16"
    if gate_only:
        return None
    for name in ("width", "ffn_dim", "budget_hidden", "selector_hidden"):
        if not _pow2(getattr(actor, name)):
            return f"actor {name}={getattr(actor, name)} is not a power of two >= 16"
    if actor.width // enc.num_heads not in TILE:
        return f"the encoder's head dim {actor.width // enc.num_heads} is not one of {sorted(TILE)}"
    if actor.width > 256:
        return f"actor width={actor.width} is over 256 (register budget of the row kernels)"
    return None


if triton is not None:

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """Rounded to the activations' dtype and back to fp32 (where an ``nn`` module's output is)."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _layer_norm(x, G, B, offs, W: tl.constexpr, eps):
        mean = tl.sum(x, 1) / W
        xc = x - mean[:, None]
        var = tl.sum(xc * xc, 1) / W
        g = tl.load(G + offs).to(tl.float32)
        b = tl.load(B + offs).to(tl.float32)
        return xc * tl.rsqrt(var + eps)[:, None] * g[None, :] + b[None, :]

    @triton.jit
    def _linear(x, Wt, Bias, outs, ins, stride_w, DT: tl.constexpr, PREC: tl.constexpr):
        """An ``nn.Linear`` on a row tile: ``x`` ``[R, IN]`` (in the dtype) times the weight's rows
        ``outs`` and columns ``ins`` (row stride ``stride_w``) plus the bias, rounded to the dtype
        as the module's output is (fp32 values)."""
        w = tl.load(Wt + outs[:, None] * stride_w + ins[None, :])
        out = tl.dot(x, tl.trans(w), input_precision=PREC) + tl.load(Bias + outs).to(tl.float32)[None, :]
        return _round(out, DT)

    @triton.jit
    def _silu(x, DT: tl.constexpr):
        """SiLU, rounded to the dtype as the module's output is."""
        return _round(x / (1.0 + tl.exp(-x)), DT)

    @triton.jit
    def _row_tile(CU, nseq, BLOCK_R: tl.constexpr, W: tl.constexpr):
        """The program's tile of a packed layout's rows: the rows, which are real (before
        ``CU[nseq]``), the rows as int64 offsets, the columns, and whether any row is real."""
        r0 = tl.program_id(0) * BLOCK_R
        total = tl.load(CU + nseq)
        rows = r0 + tl.arange(0, BLOCK_R)
        return rows, rows < total, rows.to(tl.int64), tl.arange(0, W), r0 < total

    @triton.jit
    def _seg_pos(CU, rows, live, nseq, steps):
        """Each row's sequence (the last ``j < nseq`` with ``CU[j] <= row``; rows past the last
        sequence count as its own) and position in it, by a binary search over ``CU`` in
        ``steps >= ceil(log2(nseq))`` halvings: what ``policy.segment_and_position`` computes, here
        without two ``[rows]`` tensors and the five small kernels that make them."""
        lo = tl.zeros_like(rows)  # CU[lo] <= row (CU[0] = 0); the answer lies in [lo, hi)
        hi = lo + nseq
        for _ in range(steps):
            mid = (lo + hi) // 2
            go = tl.load(CU + mid, mask=live, other=0) <= rows
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return lo, rows - tl.load(CU + lo, mask=live, other=0)

    @triton.jit
    def _gelu(x):
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _gate(CLS, ROWS, stride_b, stride_h, HD, BIAS, W1, stride_w1, W2, B2, NVIS, GATE, nseq, min_keep, step,
              D: tl.constexpr, G: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
              HAS_ROWS: tl.constexpr):
        DT = BIAS.dtype.element_ty
        seqs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        live = seqs < nseq
        gs = tl.arange(0, G)
        if HAS_ROWS:  # image i's CLS key is row ROWS[i] of a packed layout
            at = tl.load(ROWS + seqs, mask=live, other=0).to(tl.int64)
        else:
            at = seqs.to(tl.int64)
        acc = tl.zeros([BLOCK_B, G], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks < D
            # column c of the keys is head c // hd, channel c % hd (any head and image strides)
            col = (ks // HD) * stride_h + ks % HD
            a = tl.load(CLS + at[:, None] * stride_b + col[None, :], mask=live[:, None] & inside[None, :],
                        other=0.0)
            w = tl.load(W1 + gs[:, None] * stride_w1 + ks[None, :], mask=inside[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
        bias = tl.load(BIAS + seqs[:, None] * G + gs[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        hid = _round(acc + bias, DT)
        hid = _silu(hid, DT)
        logit = _round(tl.sum(hid * tl.load(W2 + gs).to(tl.float32)[None, :], 1) + tl.load(B2).to(tl.float32), DT)
        n_visual = tl.load(NVIS + seqs, mask=live, other=0)
        tl.store(GATE + seqs, (logit >= 0) & (n_visual - min_keep >= step), mask=live)

    @triton.jit
    def _gate_context(NVIS, RHO, INTERV, EMB, W1, stride_w1, B1, H, CTX, nseq, inv_n0, inv_denom,
                      D: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, G: tl.constexpr,
                      BLOCK_B: tl.constexpr):
        """Block ``program_id(1)``'s context part of the gate for a tile of images: ``h_l`` (block
        0's programs store it) and ``W1_e e_l + b1 + W1_h h_l``, each product rounded where
        :meth:`~timm_dora.policy.actor.Actor.gate_bias`'s modules round."""
        l = tl.program_id(1)
        DT = CTX.dtype.element_ty
        seqs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        live = seqs < nseq
        gs = tl.arange(0, G)
        # divided as PyTorch on CUDA divides by a number: times its float32 reciprocal
        h0 = tl.load(NVIS + seqs, mask=live, other=0).to(tl.float32) * inv_n0
        h1 = tl.load(RHO + seqs, mask=live, other=0.0).to(tl.float32)
        h2 = tl.load(INTERV + seqs, mask=live, other=0).to(tl.float32) * inv_denom
        if l == 0:
            tl.store(H + seqs * 3, h0, mask=live)
            tl.store(H + seqs * 3 + 1, h1, mask=live)
            tl.store(H + seqs * 3 + 2, h2, mask=live)
        es = tl.arange(0, EP)
        emb = tl.load(EMB + l * E + es, mask=es < E, other=0.0).to(tl.float32)  # [EP]
        w_e = tl.load(W1 + gs[:, None] * stride_w1 + D + es[None, :], mask=es[None, :] < E, other=0.0).to(tl.float32)
        block = _round(tl.sum(w_e * emb[None, :], 1) + tl.load(B1 + gs).to(tl.float32), DT)  # [G]
        image = _round(h0, DT)[:, None] * tl.load(W1 + gs * stride_w1 + D + E).to(tl.float32)[None, :]
        image += _round(h1, DT)[:, None] * tl.load(W1 + gs * stride_w1 + D + E + 1).to(tl.float32)[None, :]
        image += _round(h2, DT)[:, None] * tl.load(W1 + gs * stride_w1 + D + E + 2).to(tl.float32)[None, :]
        ctx = _round(block[None, :] + _round(image, DT), DT)
        tl.store(CTX + (l * nseq + seqs)[:, None].to(tl.int64) * G + gs[None, :], ctx.to(DT), mask=live[:, None])

    @triton.jit
    def _embed_qkv(KEYS, stride_k, H, CU, nseq, steps, WIN, BIN, EMB, WH, G1, B1, WQKV, BQKV, X, QKV, REMOVE, total,
                   eps, D: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PREC: tl.constexpr):
        rows, live, r64, cols, any_real = _row_tile(CU, nseq, BLOCK_R, W)
        # the removal flags start False (``_select`` sets them later): every row of the block's
        # layout, real or not, is some program's (the grid covers the layout's rows too)
        tl.store(REMOVE + r64, rows < 0, mask=rows < total)
        if any_real:
            DT = X.dtype.element_ty
            acc = tl.zeros([BLOCK_R, W], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(KEYS + r64[:, None] * stride_k + ks[None, :], mask=live[:, None] & (ks[None, :] < D), other=0.0)
                w = tl.load(WIN + cols[:, None] * D + ks[None, :], mask=ks[None, :] < D, other=0.0)  # [W, BLOCK_K]
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
            x = _round(acc + tl.load(BIN + cols).to(tl.float32)[None, :], DT)  # w_in(K)
            x = _round(x + tl.load(EMB + cols).to(tl.float32)[None, :], DT)  # + e^C_l
            seg, pos = _seg_pos(CU, rows, live, nseq, steps)
            cls = live & (pos == 0)
            wh = tl.zeros([BLOCK_R, W], dtype=tl.float32)  # W_h h_l on CLS rows
            for i in tl.static_range(3):
                hi = _round(tl.load(H + seg * 3 + i, mask=cls, other=0.0), DT)
                wh += hi[:, None] * tl.load(WH + cols * 3 + i).to(tl.float32)[None, :]
            x = tl.where(cls[:, None], _round(x + _round(wh, DT), DT), x)
            tl.store(X + r64[:, None] * W + cols[None, :], x.to(DT), mask=live[:, None])
            ln = _layer_norm(x, G1, B1, cols, W, eps).to(DT)
            for c in tl.static_range(3):  # q, k, v: one [W, W] slice of the qkv weight each
                out = _linear(ln, WQKV, BQKV, c * W + cols, cols, W, DT, PREC)
                tl.store(QKV + r64[:, None] * (3 * W) + c * W + cols[None, :], out.to(DT), mask=live[:, None])

    @triton.jit
    def _out_ffn(O, X, CU, nseq, steps, WP, BP, G2, B2, WF1, BF1, WF2, BF2, Z, eps,
                 NVIS, GATE, HG, HB, HW1, HB1, HW2, HB2, BUDGETS, K, FRAC, FLOPS, num_budgets, min_keep, head_eps,
                 gate_macs, quad, lin, const,
                 W: tl.constexpr, F: tl.constexpr, FCH: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
                 BH: tl.constexpr, MP: tl.constexpr, BUDGET: tl.constexpr):
        rows, live, r64, cols, any_real = _row_tile(CU, nseq, BLOCK_R, W)
        if any_real:
            DT = Z.dtype.element_ty
            o = tl.load(O + r64[:, None] * W + cols[None, :], mask=live[:, None], other=0.0)
            proj = _linear(o, WP, BP, cols, cols, W, DT, PREC)
            x = tl.load(X + r64[:, None] * W + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            x = _round(x + proj, DT)
            ln = _layer_norm(x, G2, B2, cols, W, eps).to(DT)
            acc = tl.zeros([BLOCK_R, W], dtype=tl.float32)
            for f0 in tl.static_range(0, F, FCH):  # the hidden layer in chunks of FCH units
                fs = f0 + tl.arange(0, FCH)
                hid = _gelu(_linear(ln, WF1, BF1, fs, cols, W, DT, PREC)).to(DT)
                w2 = tl.load(WF2 + cols[:, None] * F + fs[None, :])  # [W, FCH]
                acc = tl.dot(hid, tl.trans(w2), acc, input_precision=PREC)
            ffn = _round(acc + tl.load(BF2 + cols).to(tl.float32)[None, :], DT)
            z = (x + ffn).to(DT)
            tl.store(Z + r64[:, None] * W + cols[None, :], z, mask=live[:, None])
            if BUDGET:  # (few rows) the budget head here, by the programs that hold a CLS row
                seg, pos = _seg_pos(CU, rows, live, nseq, steps)
                cls = live & (pos == 0)
                if tl.max(cls.to(tl.int32), 0) > 0:
                    _budget_head(z.to(tl.float32), seg, cls, cols, NVIS, GATE, HG, HB, HW1, HB1, HW2, HB2, BUDGETS,
                                 K, FRAC, FLOPS, num_budgets, min_keep, head_eps, gate_macs, quad, lin, const,
                                 W, BH, MP, DT, PREC)
        if BUDGET:
            if tl.program_id(0) == 0:  # sequences without a row (the unplanned whole graph's, where
                # no gate opened: its cu_seqlens are zeros) have no CLS row to run the head on: no
                # removal, the gate's FLOPs (what _budget gives a closed gate, the only one such a
                # layout has)
                for s0 in range(0, nseq, 16):
                    seqs = s0 + tl.arange(0, 16)
                    empty = (seqs < nseq) & (tl.load(CU + seqs + 1, mask=seqs < nseq, other=0)
                                             <= tl.load(CU + seqs, mask=seqs < nseq, other=0))
                    n_visual = tl.load(NVIS + seqs, mask=empty, other=1)
                    k = tl.zeros([16], dtype=tl.int64)
                    tl.store(K + seqs, k, mask=empty)
                    tl.store(FRAC + seqs, k.to(tl.float32) / n_visual.to(tl.float32), mask=empty)
                    tl.store(FLOPS + seqs, 2.0 * gate_macs.to(tl.float64) + k.to(tl.float64), mask=empty)

    @triton.jit
    def _budget_head(z, seqs, live, cols, NVIS, GATE, G, B, W1, B1, W2, B2, BUDGETS, K, FRAC, FLOPS, num_budgets,
                     min_keep, eps, gate_macs, quad, lin, const,
                     W: tl.constexpr, BH: tl.constexpr, MP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
        """The budget head on the rows ``z`` (fp32 values of ``Z_CLS``; ``live``: which are, of
        the sequences ``seqs``): ``k``, ``k / N_l`` and the actor's FLOPs of those sequences."""
        ln = _layer_norm(z, G, B, cols, W, eps).to(DT)
        hs = tl.arange(0, BH)
        hid = _gelu(_linear(ln, W1, B1, hs, cols, W, DT, PREC)).to(DT)
        ms = tl.arange(0, MP)
        exists = ms < num_budgets
        w2 = tl.load(W2 + ms[:, None] * BH + hs[None, :], mask=exists[:, None], other=0.0)
        logits = _round(tl.dot(hid, tl.trans(w2), input_precision=PREC)
                        + tl.load(B2 + ms, mask=exists, other=0.0).to(tl.float32)[None, :], DT)
        budgets = tl.load(BUDGETS + ms, mask=exists, other=0)
        n_visual = tl.load(NVIS + seqs, mask=live, other=0)
        feasible = exists[None, :] & (budgets[None, :] <= n_visual[:, None] - min_keep)
        index = tl.argmax(tl.where(feasible, logits, float("-inf")), 1, tie_break_left=True)
        gate = tl.load(GATE + seqs, mask=live, other=0) != 0
        k = tl.where(gate, tl.load(BUDGETS + index, mask=live, other=0), 0)
        tl.store(K + seqs, k, mask=live)
        tl.store(FRAC + seqs, k.to(tl.float32) / n_visual.to(tl.float32), mask=live)
        # the FLOPs (flops.actor_controller_macs, in float64: integer-valued and exact below 2**53)
        n = n_visual.to(tl.float64) + 1.0
        macs = n * (n * quad.to(tl.float64) + lin.to(tl.float64)) + const.to(tl.float64)
        flops = 2.0 * gate_macs.to(tl.float64) + tl.where(gate, 2.0 * macs, 0.0)
        tl.store(FLOPS + seqs, flops, mask=live)

    @triton.jit
    def _budget(Z, CU, NVIS, GATE, G, B, W1, B1, W2, B2, BUDGETS, K, FRAC, FLOPS, nseq, num_budgets, min_keep, eps,
                gate_macs, quad, lin, const,
                W: tl.constexpr, BH: tl.constexpr, MP: tl.constexpr, BLOCK_B: tl.constexpr, PREC: tl.constexpr):
        DT = Z.dtype.element_ty
        seqs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        live = seqs < nseq
        cols = tl.arange(0, W)
        first = tl.load(CU + seqs, mask=live, other=0).to(tl.int64)  # the CLS row of each sequence
        z = tl.load(Z + first[:, None] * W + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        _budget_head(z, seqs, live, cols, NVIS, GATE, G, B, W1, B1, W2, B2, BUDGETS, K, FRAC, FLOPS, num_budgets,
                     min_keep, eps, gate_macs, quad, lin, const, W, BH, MP, DT, PREC)

    @triton.jit
    def _scores(Z, CU, nseq, steps, FRAC, WK, WS1, BS1, WS2, BS2, SC,
                W: tl.constexpr, S: tl.constexpr, NP: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr):
        rows, live, r64, cols, any_real = _row_tile(CU, nseq, BLOCK_R, W)
        if any_real:
            DT = Z.dtype.element_ty
            seg, pos = _seg_pos(CU, rows, live, nseq, steps)
            visual = live & (pos >= 1)
            z = tl.load(Z + r64[:, None] * W + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            # the selector MLP_S(Z_j + W_k k/N_l)
            frac = tl.load(FRAC + seg, mask=live, other=0.0)
            cond = _round(_round(frac, DT)[:, None] * tl.load(WK + cols).to(tl.float32)[None, :], DT)  # W_k (k / N_l)
            zc = (z + cond).to(DT)
            ss = tl.arange(0, S)
            hid = _silu(_linear(zc, WS1, BS1, ss, cols, W, DT, PREC), DT)
            s = tl.sum(hid * tl.load(WS2 + ss).to(tl.float32)[None, :], 1) + tl.load(BS2).to(tl.float32)
            tl.store(SC + seg.to(tl.int64) * NP + (pos - 1), _round(s, DT), mask=visual)

    @triton.jit
    def _select(SC, CU, CU_OUT, K, REMOVE, num_prefix, NP: tl.constexpr, CH: tl.constexpr):
        seq, chunk = tl.program_id(0), tl.program_id(1)
        start = tl.load(CU + seq)
        n = tl.load(CU + seq + 1) - start - 1  # visual tokens of this sequence
        if chunk * CH < n:
            every = tl.arange(0, NP)
            mine = chunk * CH + tl.arange(0, CH)
            s_all = tl.load(SC + seq * NP + every, mask=every < n, other=float("-inf"))
            s_mine = tl.load(SC + seq * NP + mine, mask=mine < n, other=float("-inf"))
            # rank in a stable descending sort: higher scores, and equal scores at lower indices
            ahead = (s_all[None, :] > s_mine[:, None]) | ((s_all[None, :] == s_mine[:, None]) & (every[None, :] < mine[:, None]))
            ahead = ahead & (every[None, :] < n)
            rank = tl.sum(ahead.to(tl.int32), 1)
            out = tl.load(CU_OUT + seq).to(tl.int64) + num_prefix + mine
            tl.store(REMOVE + out, rank < tl.load(K + seq), mask=mine < n)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows_tile(default: Tuple[int, int], rows: int) -> Tuple[int, int]:
    """A row kernel's ``(rows per program, warps)`` for ``rows`` rows: ``default`` (:data:`TILE_ROWS`)
    where its grid has :data:`SMALL_GRID` programs or more, else the tile halved until it has (at
    least 16 rows, 4 warps). The tile changes how rows are split among programs, not the products of
    a row (and, for ``out_ffn``, whether its programs also run the budget head:
    :data:`BUDGET_IN_FFN_ROWS`; its float32 LayerNorm sums may then be ordered otherwise, a last
    place apart, so near-tied budgets may go the other way)."""
    block, warps = default
    if -(-rows // block) >= SMALL_GRID:
        return default
    while block > 16 and -(-rows // block) < SMALL_GRID:
        block //= 2
    return block, min(warps, 4)


def _recip32(n: int) -> float:
    """``1 / n`` in float32 (exactly representable as the kernel's float32 argument)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / n)


@torch.compiler.disable  # under torch.compile: run eagerly (Dynamo would trace the Triton launches)
def fused_gate(actor, cls_keys: torch.Tensor, bias: torch.Tensor, n_visual: torch.Tensor,
               out: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The deterministic gate of ``actor`` (``p^G >= 0.5``, i.e. logit ``>= 0``) where a budget is
    feasible: ``[B]`` bool (into ``out`` when given).

    ``cls_keys``: ``[B, d]`` or ``[B, H, hd]`` CLS keys in the actor's dtype (any image and head
    strides, unit channel stride: e.g. ``k[:, :, 0]`` of a ``[B, H, S, hd]`` key tensor, no copy);
    with ``rows`` (``[B]`` integers), the keys of a packed layout's rows ``[T, d]`` or ``[T, H, hd]``,
    image ``i``'s CLS key at row ``rows[i]`` (read in place: no gather);
    ``bias``: ``[B, 64]``, the first layer's context part plus its bias for this block
    (:meth:`~timm_dora.policy.actor.Actor.gate_bias`); ``n_visual``: ``[B]`` visual-token counts. Rounded
    where the ``nn`` modules round (the same decisions up to near-ties of the logit at 0).
    """
    reason = fused_controller_reason(actor, cls_keys.dtype, gate_only=True)
    if reason is not None:
        raise ValueError(f"fused gate: {reason}")
    b, d, g = cls_keys.shape[0] if rows is None else rows.shape[0], actor.embed_dim, actor.gate_hidden
    if cls_keys.dim() == 2:
        cls3 = cls_keys.view(cls_keys.shape[0], 1, d) if cls_keys.stride(1) == 1 else None
    else:
        cls3 = cls_keys
    if cls3 is None or cls3.shape[1] * cls3.shape[2] != d or cls3.stride(2) != 1:
        raise ValueError(f"CLS keys must be [B, {d}] or [B, H, hd] with unit channel stride, got {tuple(cls_keys.shape)}"
                         f" strides {cls_keys.stride()}")
    if cls_keys.dtype != actor.w_in.weight.dtype or bias.dtype != cls_keys.dtype:
        raise ValueError(f"CLS keys ({cls_keys.dtype}), gate bias ({bias.dtype}) and the actor "
                         f"({actor.w_in.weight.dtype}) must have one dtype")
    if bias.shape != (b, g) or not bias.is_contiguous():
        raise ValueError(f"gate bias must be a contiguous [{b}, {g}], got {tuple(bias.shape)}")
    first, second = actor.gate_mlp[0], actor.gate_mlp[2]
    out = torch.empty(b, dtype=torch.bool, device=cls_keys.device) if out is None else out
    hd = cls3.shape[2]
    gl = GATE_LAUNCH
    _gate[(_cdiv(b, gl["images"]),)](cls3, cls3 if rows is None else rows, cls3.stride(0), cls3.stride(1), hd, bias,
                                     first.weight, first.weight.stride(0),
                                     second.weight, second.bias, n_visual, out, b, actor.min_keep, actor.budget_step,
                                     D=d, G=g, BLOCK_B=gl["images"], BLOCK_K=gl["k_block"] if d >= gl["k_block"] else (64 if d >= 64 else 32),
                                     PREC="ieee" if cls_keys.dtype == torch.float32 else "tf32",
                                     HAS_ROWS=rows is not None, num_warps=gl["num_warps"], num_stages=gl["num_stages"])
    return out


@torch.compiler.disable  # under torch.compile: run eagerly (Dynamo would trace the Triton launches)
def fused_gate_context(actor, n_visual: torch.Tensor, rho: torch.Tensor, interventions: torch.Tensor,
                       num_patches: int, dtype: torch.dtype,
                       out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gate's history part in one kernel: ``(h_l [B, 3] float32, W1_c [e^G_l; h_l] + b1 for
    every block [L, B, G] in dtype)``, what :meth:`~timm_dora.policy.actor.Actor.history` and
    :meth:`~timm_dora.policy.actor.Actor.gate_bias` (``block=None``) compute in about ten kernels;
    into ``out`` when given. Rounded where those modules round, and ``h_l`` divided as they divide on
    CUDA (times the float32 reciprocal: on the CPU PyTorch divides exactly, a last-place apart)."""
    reason = fused_controller_reason(actor, dtype, gate_only=True)
    if reason is not None:
        raise ValueError(f"fused gate context: {reason}")
    b, depth, g = n_visual.shape[0], actor.depth, actor.gate_hidden
    first, e = actor.gate_mlp[0], actor.gate_embed_dim
    if first.weight.dtype != dtype or actor.gate_embed.dtype != dtype:
        raise ValueError(f"the actor ({first.weight.dtype}) must be in the activations' dtype ({dtype})")
    dev = n_visual.device
    if any(t.shape != (b,) or t.stride(0) != 1 for t in (n_visual, rho, interventions)):
        raise ValueError(f"N_l, rho and E_<l must be contiguous [{b}] vectors")
    if out is None:
        out = (torch.empty(b, 3, dtype=torch.float32, device=dev), torch.empty(depth, b, g, dtype=dtype, device=dev))
    h, ctx = out
    if h.shape != (b, 3) or h.dtype != torch.float32 or ctx.shape != (depth, b, g) or ctx.dtype != dtype \
            or not (h.is_contiguous() and ctx.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 [{b}, 3] and {dtype} [{depth}, {b}, {g}]")
    images = 16
    _gate_context[(_cdiv(b, images), depth)](n_visual, rho, interventions, actor.gate_embed, first.weight,
                                              first.weight.stride(0), first.bias, h, ctx, b, _recip32(num_patches),
                                              _recip32(max(actor.depth - 1, 1)), D=actor.embed_dim, E=e,
                                              EP=max(16, triton.next_power_of_2(e)), G=g, BLOCK_B=images, num_warps=4)
    return h, ctx


@torch.compiler.disable  # under torch.compile: run eagerly (Dynamo would trace the Triton launches)
def fused_controller(actor, keys: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, h: torch.Tensor,
                     n_visual: torch.Tensor, gate: torch.Tensor, block: int, cu_out: torch.Tensor, num_prefix: int,
                     total: int, tile: Union[Tuple[int, int], Dict[str, Tuple[int, int]], None] = None,
                     out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                     launch: Optional[Dict[str, int]] = None, await_gate: Optional[Callable[[], None]] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deterministic controller of ``actor`` on a packed controller layout (see the module).

    ``keys``: ``[rows, d]`` in the actor's dtype, one sequence per image (its CLS key first, then
    its visual keys; rows past the last sequence ignored), delimited by ``cu_seqlens`` (``[B+1]``
    int32); ``max_len``: an upper bound of the lengths; ``h``: ``[B, 3]`` history; ``n_visual``:
    ``[B]`` visual-token counts; ``gate``: ``[B]`` bool; ``block``: the block index. The removal
    flags are written for the block's own layout: ``cu_out`` (``[B+1]``, its sequence starts),
    ``num_prefix`` prefix rows per sequence, ``total`` rows. Returns ``(remove [total] bool,
    k [B] int64, flops [B] float64)``: the flags, the budgets (0 where the gate is closed) and the
    actor's FLOPs per image (:func:`timm_dora.policy.actor_flops.actor_gate_macs` at every image plus
    :func:`~timm_dora.policy.actor_flops.actor_controller_macs` where the gate is open, doubled), into ``out``
    when given (``remove`` may be longer than ``total``: only its first ``total`` entries are
    written). ``tile``: ``(rows per program, warps)`` for the row-wise kernels instead of
    :data:`TILE_ROWS` (smaller tiles for few rows: :func:`_rows_tile`), or a dict of such pairs per kernel (``"embed"``, ``"out_ffn"``,
    ``"scores"``; the missing ones keep :data:`TILE_ROWS`'s), for benchmarks. ``launch``: entries of :data:`ROW_LAUNCH` to use instead
    (``num_stages``, ``k_block``, ``ffn_chunk``), for benchmarks. ``await_gate``: called after the
    encoder's first two kernels are enqueued, before the first that reads ``gate`` (the budget
    head's): the graphs enqueue the gate's own kernel there, beside them.
    """
    reason = fused_controller_reason(actor, keys.dtype)
    if reason is not None:
        raise ValueError(f"fused controller: {reason}")
    if keys.dim() != 2 or keys.shape[1] != actor.embed_dim or keys.stride(1) != 1:
        raise ValueError(f"keys must be [rows, {actor.embed_dim}] with unit column stride, got {tuple(keys.shape)}")
    if keys.dtype != actor.w_in.weight.dtype:
        raise ValueError(f"keys are {keys.dtype}, the actor's weights {actor.w_in.weight.dtype}")
    dev, dt, rows = keys.device, keys.dtype, keys.shape[0]
    b, w, d = gate.shape[0], actor.width, actor.embed_dim
    enc, bh, sel = actor.encoder, actor.budget_head, actor.selector
    prec = "ieee" if dt == torch.float32 else "tf32"  # fp32 (the CPU tests) exact; half: irrelevant
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    h = h.float().contiguous()
    if out is None:
        out = (torch.empty(total, dtype=torch.bool, device=dev), torch.empty(b, dtype=torch.long, device=dev),
               torch.empty(b, dtype=torch.float64, device=dev))
    remove, k_out, flops = out
    if remove.shape[0] < total or k_out.shape != (b,) or flops.shape != (b,) or remove.dtype != torch.bool \
            or k_out.dtype != torch.long or flops.dtype != torch.float64 or not remove.is_contiguous():
        raise ValueError(f"out must be (remove [>= {total}] bool, k [{b}] int64, flops [{b}] float64)")
    steps = max(1, (b - 1).bit_length())  # halvings of the binary search for each row's sequence
    if isinstance(tile, dict) and not set(tile) <= set(TILE_ROWS):
        raise ValueError(f"tile: unknown kernels {sorted(set(tile) - set(TILE_ROWS))} (known: {list(TILE_ROWS)})")
    tiles = {k: (tile.get(k, default) if isinstance(tile, dict) else tile) if tile is not None
             else _rows_tile(default, max(rows, total)) for k, default in TILE_ROWS.items()}
    if launch is not None and not set(launch) <= set(ROW_LAUNCH):
        raise ValueError(f"launch: unknown entries {sorted(set(launch) - set(ROW_LAUNCH))} (known: {list(ROW_LAUNCH)})")
    rl = {**ROW_LAUNCH, **(launch or {})}
    x = torch.empty((rows, w), dtype=dt, device=dev)
    qkv = torch.empty((rows, 3 * w), dtype=dt, device=dev)
    # (its grid also covers the block layout's rows, whose removal flags it sets False)
    block_r, warps = tiles["embed"]
    _embed_qkv[(_cdiv(max(rows, total), block_r),)](
        keys, keys.stride(0), h, cu, b, steps, actor.w_in.weight, actor.w_in.bias, actor.block_embed[block],
        actor.w_h.weight, enc.norm1.weight, enc.norm1.bias, enc.qkv.weight, enc.qkv.bias, x, qkv, remove, total,
        enc.norm1.eps, D=d, W=w, BLOCK_R=block_r, BLOCK_K=rl["k_block"] if d >= rl["k_block"] else 32,
        PREC=prec, num_warps=warps, num_stages=rl["num_stages"])
    heads = enc.num_heads
    q, k, v = qkv.view(rows, 3, heads, w // heads).unbind(1)
    o = varlen_attention_triton(q, k, v, cu, max_len, (w // heads) ** -0.5)
    z = torch.empty_like(x)
    m = actor.num_budgets
    mp = max(16, triton.next_power_of_2(m))
    frac = torch.empty(b, dtype=torch.float32, device=dev)
    per_token, fixed, selector, _ = controller_macs_terms(actor)
    head = (n_visual, gate, bh[0].weight, bh[0].bias, bh[1].weight, bh[1].bias, bh[3].weight, bh[3].bias,
            actor.budgets, k_out, frac, flops)
    terms = (m, actor.min_keep, bh[0].eps, actor_gate_macs(actor), 2 * w, per_token + selector, fixed - selector)
    block_r, warps = tiles["out_ffn"]
    in_ffn = 0 < rows and block_r <= BUDGET_IN_FFN_ROWS  # (few rows: the budget head in _out_ffn, no _budget)
    if await_gate is not None:  # (nothing before reads the gate)
        await_gate()
    _out_ffn[(_cdiv(rows, block_r),)](
        o, x, cu, b, steps, enc.proj.weight, enc.proj.bias, enc.norm2.weight, enc.norm2.bias, enc.fc1.weight,
        enc.fc1.bias, enc.fc2.weight, enc.fc2.bias, z, enc.norm2.eps, *head, *terms, W=w, F=actor.ffn_dim,
        FCH=min(actor.ffn_dim, rl["ffn_chunk"]), BLOCK_R=block_r, PREC=prec, BH=actor.budget_hidden, MP=mp,
        BUDGET=in_ffn, num_warps=warps, num_stages=rl["num_stages"])
    np_ = max(16, triton.next_power_of_2(actor.num_patches))
    scores = torch.empty((b, np_), dtype=torch.float32, device=dev)
    selector_weights = (actor.w_k.weight, sel[0].weight, sel[0].bias, sel[2].weight, sel[2].bias, scores)
    ch = min(64, np_)
    if not in_ffn:
        _budget[(_cdiv(b, 16),)](z, cu, *head, b, *terms, W=w, BH=actor.budget_hidden, MP=mp, BLOCK_B=16, PREC=prec,
                                 num_warps=tiles["scores"][1])
    block_r, warps = tiles["scores"]
    _scores[(_cdiv(rows, block_r),)](z, cu, b, steps, frac, *selector_weights, W=w, S=actor.selector_hidden, NP=np_,
                                     BLOCK_R=block_r, PREC=prec, num_warps=warps)
    _select[(b, np_ // ch)](scores, cu, cu_out, k_out, remove, num_prefix, NP=np_, CH=ch, num_warps=tiles["scores"][1])
    return remove[:total], k_out, flops
