"""How the engine runs a wrapped model: :class:`EngineOptions`, carried by the model.

Every option changes speed or memory only, never what a forward computes (up to rounding where a
kernel differs). A model gets them from ``wrap(model, ..., options=EngineOptions(...))`` and keeps
them in its state; :func:`~timm_dora.engine.capture.set_options` changes them later (its captured
graphs are released, since they were recorded under the old ones). While a wrapped model's forward
runs, its options are the *active* ones (:func:`active`, a context variable that
:func:`~timm_dora.engine.patch.run` sets for the duration of the call), so the engine's modules read
them without being handed the model, and two models in one process can run with different options.

A model wrapped without options runs with the active ones: :class:`EngineOptions` defaults, or
those of an enclosing ``with using(EngineOptions(...)):`` block (how tests and A/B benchmarks switch
one setting for a stretch of code). Its graphs are kept per options, so a forward never replays a
graph recorded under others.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = ["EngineOptions", "active", "using"]


@dataclass(frozen=True)
class EngineOptions:
    """The engine's settings; the defaults are the fast path measured in ``docs/performance.md``."""

    # Triton kernels for the dense LayerNorm and the patch embedding as one matrix product (CUDA,
    # half precision, no autograd); False: the modules' own forward
    dense_kernels: bool = True
    # merging's fold in engine.fold_kernel's Triton kernels (CUDA, no autograd); False: PyTorch ops
    fold_kernel: bool = True
    # with the actor's Triton kernels, at a block whose gate opened in the last forward, the
    # controller and the deletion run in the attention's graph, reading the keys in place from its
    # qkv output (the actor's share 4.3 -> 4.0 % on DeiT-B, 18.2 -> 17.2 % on ViT-Ti, H100); False:
    # two graphs
    fused_interventions: bool = True
    # the captured controller graph's deletion (survivors' index, the gathers of rows and ids, the
    # new lengths and cu_seqlens) in engine.deletion_kernel's two Triton kernels instead of about 13
    # PyTorch ones (CUDA, merge included; one program up to 8192 rows, above that five kernels):
    # 35 graph nodes fewer and 2-8 % faster requests at batches 1-16 on an H200, 7-9 % faster
    # forwards of 320 Tiny images (benchmarks/results/planned_large_multi_deletion_h200.json);
    # False: the PyTorch ops
    fused_deletion: bool = True
    # with the actor, the dense blocks up to the first whose gate opened in the last forward run
    # ahead as one graph, their gates taken as closed and read once where the host must know; where
    # one opened after all the forward runs again without (graphs.RunAheadMissed)
    run_ahead: bool = True
    # batch shapes (and policies) above planned_max_batch whose graphs a wrapped model keeps, least
    # recent dropped (DeiT-B's at 320: about 1.1 GB; benchmarks/results/default_speed_h100.json)
    max_cached: int = 4
    # the same for batches up to planned_max_batch, kept apart: 12 holds every bucket of 1-16 images
    # (1-8, 10, 12, 14, 16) for one policy and input size, so a server whose requests come in more
    # than four sizes captures each once instead of at nearly every request (an eager forward and a
    # capture, 1.6-1.8 s in serving_latency's misses on an H200); one graph of up to 16 images holds
    # 22-26 MB for DeiT-B (benchmarks/results/default_speed_h100_previous.json)
    max_cached_small: int = 12
    # packed rows padded up to a multiple of this (None: graphs.rows_bucket's rule; tests fix it)
    rows_bucket: Optional[int] = None
    # before a runner's first capture, one segment of the graphs' memory pool is reserved for the
    # largest expected scratch, so that every capture carves its intermediates out of it (without:
    # about 14 [B*S, d] tensors reserved where 9 are live at once)
    reserve_pool: bool = True
    # a graph segment's MLP in this many row chunks (1: all rows at once): a smaller memory pool
    mlp_chunks: int = 1
    # batches up to this size run as one *unplanned* whole-forward graph when captured (0: none; the
    # planned graph was faster at every batch size measured, benchmarks/results/small_batch_h100.json)
    whole_max_batch: int = 0
    # the unplanned whole graph: None, as whole_max_batch says; True, every forward the runner can
    # run whole, captured or not (the CPU tests run it uncaptured); False, never
    whole: Optional[bool] = None
    # the planned whole graph for batches up to planned_max_batch: None, when captured; True,
    # wherever the runner can run whole (the CPU tests run it uncaptured); False, never
    planned: Optional[bool] = None
    # the crossover against the per-block executor on an H100 (benchmarks/small_batch.py: the
    # planned graph 7-56 % faster at batches 1, 8 and 16; at 32 and 64 the two trade places)
    planned_max_batch: int = 16
    # larger batches also run as the planned graph while their dense work (the batch times the
    # backbone's GFLOPs an image) is at most this: there the per-block executor's host waits (a
    # gate read per block, the lengths after each deletion) cost more than the plan's padded rows.
    # One H200, batch 320 (about 800 GFLOPs for ViT-Ti and DeiT-Ti): the planned graph 14 % and
    # 10 % faster; DeiT-B at 320 (11,240 GFLOPs) 1 % slower (benchmarks/results/planned_large_h200.json).
    # So DeiT-B runs planned up to 56 images: with an older engine on an H100
    # (benchmarks/results/small_batch_h100.json) planned was 4 % faster at 32, 6 % slower at 64
    planned_max_gflops: float = 1000.0
    # a plan's bound on the rows entering a block: the rows seen there plus this many standard
    # deviations of a batch's total (sqrt(B) times the per-image standard deviation of the lengths)
    margin_sd: float = 4.0
    # in the planned whole graph, the actor's work at a block without a controller (its gate, which
    # only the plan's check reads, the history part where it changed, rho's reset), the check's
    # copies and the closed blocks' record rows run on a second stream beside the block's attention
    # and MLP, joined at the next block: captured, a branch of the graph, off the chain of kernels a
    # request waits for; False: in line
    aside_gates: bool = True
    # in the planned whole graph (captured, the Triton gate), a controller block's decision (the
    # actor's controller after the block's gate) on that second stream beside the block's attention,
    # projection and residual, joined before the fold and the deletion: the chain a request waits
    # for loses the shorter of the two branches (the attention's). One H200, requests timed to the
    # logits (benchmarks/options_ab.py, benchmarks/results/aside_controller_h200.json): merging
    # DeiT-Ti +9.7 % images/s at one image and +6.1 % at eight, DeiT-B forced +0.3 / +8.7 / -1.4 %
    # at 1 / 2 / 4; at batch 320 ViT-Ti 3.59 -> 3.53 ms and DeiT-Ti 4.42 -> 4.35 ms a forward
    aside_controller: bool = True
    # with aside_controller and merge=True, up to fold_aside_max_rows rows of images of up to
    # engine.fold_kernel.SIMILARITY_MAX_COLUMNS tokens, the fold's first half, which needs no
    # decision (every row's metric against its image's rows, fold_similarities), runs on the block's
    # own stream beside the decision; after the join the match and the scatter are one kernel that
    # reads them (fold_kernel._pick). False: the match after the join, as above the bound
    fold_aside: bool = True
    # fold_aside's bound on a batch's rows (their similarities are a float32 buffer of up to 256
    # columns a row: 8 MB at 8,192 rows, 41 images of 197; 64 MB at 320 images). Above it the GPU
    # is full without them: at 320 merging DeiT-Ti images, 3.75 -> 3.98 ms a forward with the
    # similarities beside the decision (one H200, benchmarks/results/aside_priority_h200.json.gz)
    fold_aside_max_rows: int = 8192
    # with fused_deletion and the fold kernels (merge=True, a model with a class or register token),
    # the fold's last step (each row that received: its size-weighted mean, its new size, the
    # accumulators back to zeros) runs inside the deletion's gather instead of as a kernel of its
    # own before it: one kernel and one pass over the rows fewer per deletion. False: the fold's
    # own finish
    fold_in_gather: bool = True
    # with aside_controller, the decision is forked before the block's gate, not after it: the
    # controller's first kernels (the encoder's, which read the keys and the history) run beside
    # the gate, and the decision waits for the gate only before its budget head, the first kernel
    # that reads it. The chain a request waits for loses the gate's kernel at each controller
    # block. False: the gate, then the fork
    gate_beside_decision: bool = True
    # each timm Mlp's fc1 and exact GELU as one Triton kernel (engine.mlp_kernel; CUDA, half
    # precision, no autograd, fc1 192 wide, up to mlp_kernel.MAX_ROWS rows): one kernel and one
    # graph node a block fewer. One H200, requests timed to the logits (benchmarks/options_ab.py,
    # benchmarks/results/fused_gelu_ab_h200.json.gz): merging DeiT-Ti +10.2 / +9.6 / +4.2 % images/s
    # at 1 / 4 / 16 images, ViT-Ti +2.0 / +4.3 / -1.3 %. Above MAX_ROWS and at 768 wide, cuBLAS and
    # ATen's GELU are faster (benchmarks/results/gelu_tiles_h200.json.gz). False: timm's Mlp
    fused_gelu: bool = True
    # with fold_in_gather in the whole graph, the deletion's compaction (the survivors' index, the
    # ids, the new layout, the books) runs on the Aside stream beside the fold's match and scatter,
    # which it does not wait for: it reads only the decision's flags, and leaves the new cu_seqlens
    # and sizes aside for the gather to copy back (deletion_kernel.compact_rows, gather_rows).
    # None: above deletion_kernel.MAX_ROWS rows, where the compaction is three kernels and its sizes
    # go straight into the aside buffer (one copy kernel fewer). One H200, merging DeiT-Ti: 3.84 ->
    # 3.72 ms a forward of 320 images (0.755 -> 0.778 of the captured oracle;
    # benchmarks/results/fold_race_h200.json.gz); requests of 1 / 2 / 8 / 16 images -11 / +10 / +3
    # / -8 % images/s, p50 0.69 -> 0.80 ms at one image
    # (benchmarks/results/compact_beside_fold_h200.json.gz). True: at every size; False: the fold,
    # then the deletion's two kernels
    compact_beside_fold: Optional[bool] = None
    # in the whole graph, the LayerNorm before a pruned block's MLP (its norm2 of the survivors)
    # runs inside the deletion's gather (deletion_kernel.gather_rows' norm; rows of at most
    # GATHER_BLOCK_D channels, else after the deletion): one kernel fewer per deletion. None: up to
    # deletion_kernel.MAX_ROWS rows. One H200 (benchmarks/results/norm_in_gather_h200.json.gz),
    # requests of 1 / 8 / 16 images, images/s: merging DeiT-Ti +3.8 / +1.3 / +1.4 %, ViT-Ti +1.4 /
    # +0.5 / +4.7 %; a forward of 320 images DeiT-Ti 3.79 -> 3.78 ms, ViT-Ti 3.36 -> 3.40 (slower,
    # hence not there by default). True: at every size; False: the MLP's own LayerNorm
    norm_in_gather: Optional[bool] = None
    # with fold_aside's similarities and fold_in_gather, the fold's pick (each removed row's best
    # survivor read from the similarities, scattered) and the deletion's compaction, by image
    # (deletion_kernel.compact_rows' per_image: a program per image, the new ids, cu_seqlens and
    # sizes aside for the gather to copy back) as one launch, deletion_kernel.pick_and_compact:
    # one kernel fewer on the chain a request waits for at each deletion. One H200, merging DeiT-Ti
    # requests of 1 / 2 / 4 / 8 / 16 images: +3.2 / +1.3 / +3.0 / +6.1 / +1.2 % images/s
    # (benchmarks/results/compact_in_pick_h200.json.gz). False: the pick, then the compaction
    # (beside it on the Aside stream with compact_beside_fold)
    compact_in_pick: bool = True
    # in the whole graph (the CLS-token readout), where the plan runs the controller at the last
    # block, that block's MLP runs on the prefix rows only, read from its attention's output
    # before the deletion, and the readout follows at once, beside the decision: no later block
    # reads the other rows, and the MLP is per row. The deletion keeps only its books (the
    # statistics' record and the plan's check): no fold, no gather, no MLP of the survivors.
    # The logits are the same up to the MLP's rounding on fewer rows; the statistics count the
    # survivors' MLP as before. The plan's check runs right after the last gate (the last
    # deletion's rows bound nothing). One H200: merging DeiT-Ti +5.0 / +2.8 % images/s at 1 / 16
    # images, 3.89 -> 3.82 ms at 320; ViT-Ti +2.6 / +7.4 %, equal at 320
    # (benchmarks/results/last_block_prefix_h200.json.gz). False: the deletion, the MLP of the
    # survivors, then the readout
    last_block_prefix_only: bool = True

    def __post_init__(self) -> None:
        for name in ("max_cached", "max_cached_small", "mlp_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineOptions.{name} must be at least 1, got {getattr(self, name)}")
        if self.rows_bucket is not None and self.rows_bucket < 1:
            raise ValueError(f"EngineOptions.rows_bucket must be at least 1 or None, got {self.rows_bucket}")
        if (self.whole_max_batch < 0 or self.planned_max_batch < 0 or not self.margin_sd >= 0
                or not self.planned_max_gflops >= 0 or self.fold_aside_max_rows < 0):
            raise ValueError("EngineOptions.whole_max_batch, planned_max_batch, planned_max_gflops, margin_sd and "
                             "fold_aside_max_rows must be 0 or more")


_ACTIVE: "contextvars.ContextVar[EngineOptions]" = contextvars.ContextVar("timm_dora_engine_options",
                                                                          default=EngineOptions())


def active() -> EngineOptions:
    """The options of the wrapped model whose forward is running (the defaults outside one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(options: EngineOptions) -> Iterator[EngineOptions]:
    """Make ``options`` the active ones for the ``with`` block (nested blocks restore on exit)."""
    token = _ACTIVE.set(options)
    try:
        yield options
    finally:
        _ACTIVE.reset(token)
