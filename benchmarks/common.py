"""Helpers the benchmark scripts share (not a script: nothing here measures on its own).

Every script in ``benchmarks/`` runs from the repository root as a module (Python then puts the
root on the module search path by its own rule, so ``benchmarks.common`` imports without a path
edit)::

    python -m benchmarks.<name> --help

Grouped by what uses them: the command recorded in a result (:func:`command_line`); the dense
static-schedule oracle and the fixed and forced policies of the throughput rows (``throughput``,
``memory_breakdown``, ``profile_forward``, ``trained_oracle``, ``default_speed``; the tests); the
engine settings a graph row is measured under (``throughput``, ``memory_breakdown``); the
configurations and timing of ``default_speed``, ``small_batch`` and ``serving_latency``; the pool and its paired row
(``pool_studies``); the paired accuracy rows of ``tradeoff``, ``choose_seed`` and ``seen_unseen``;
replay plans recorded from or drawn for a policy (``gpu_check``, ``profile_forward``; the tests).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import timm_dora
from timm_dora import Actor, EngineOptions
from timm_dora.engine.options import using
from timm_dora.engine.flops import backbone_cost
from timm_dora.evaluate import bench, build_method, environment, load_model, loader_for
from timm_dora.evaluate.baselines.selectors import RecordedSelector
from timm_dora.hub.published import resolve_actor


# ------------------------------------------------------------------------------------- command lines
def log(msg: str, t0: float) -> None:
    """``msg`` with the seconds since ``t0`` (``time.perf_counter()``), flushed at once."""
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def command_line(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command a result records: ``python -m benchmarks.<script>`` and ``argv`` (the process's
    own arguments when ``None``)."""
    return " ".join([f"python -m benchmarks.{script}"] + list(sys.argv[1:] if argv is None else argv))


def graph_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn`` run ``calls`` times back to back inside one CUDA graph (a
    small request is a chain of such nodes): after three eager calls (compilation) and three
    replays, the median over ``repeats`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times[3:])


# ---------------------------------------------------- static schedules, the dense oracle, fixed policies
def fixed_plan(batch: int, n0: int, blocks: List[int], mean_k: List[int], spread: int, seed: int, device):
    """Per-image variable budgets: image i removes ``mean_k[j] + u_i`` at ``blocks[j]``, u_i uniform
    in ``[-spread, spread]`` (even), random columns."""
    g = torch.Generator().manual_seed(seed)
    n = [n0] * batch
    plan = {}
    for l, mk in zip(blocks, mean_k):
        imgs, cols = [], []
        for i in range(batch):
            k = mk + 2 * int(torch.randint(-spread // 2, spread // 2 + 1, (1,), generator=g))
            k = max(0, min(k, n[i] - 4))
            imgs += [i] * k
            cols += torch.randperm(n[i], generator=g)[:k].tolist()
            n[i] -= k
        plan[l] = (torch.tensor(imgs, device=device), torch.tensor(cols, device=device))
    return plan


def schedule_for_reduction(model, target: float, blocks: List[int]):
    """Equal per-intervention removal counts reaching about ``target`` GFLOPs reduction."""
    cost = backbone_cost(model)
    n0 = cost.num_patches
    native = 2 * cost.native_macs() / 1e9
    best = None
    for k in range(0, n0 // len(blocks) + 1, 2):
        n, ks = n0, {}
        for l in sorted(blocks):
            ks[l] = min(k, n - 4)
            n -= ks[l]
        red = 1 - oracle_gflops(model, ks) / native
        if best is None or abs(red - target) < abs(best[0] - target):
            best = (red, [ks[l] for l in blocks])
    return best[1]


def oracle_gflops(model, ks: Dict[int, int]) -> float:
    """GFLOPs of the dense static schedule removing ``ks[l]`` tokens after block ``l``'s attention."""
    cost = backbone_cost(model)
    n, macs = cost.num_patches, cost.patch_macs + cost.head_macs
    for l in range(len(cost.qkv_macs)):
        kk = ks.get(l, 0)
        macs += float(cost.block_macs(l, torch.tensor([n + cost.num_prefix]), torch.tensor([n + cost.num_prefix - kk])))
        n -= kk
    return 2 * macs / 1e9


def matched_counts(model, per_block: Dict[int, float], target_gflops: float) -> Dict[int, int]:
    """A static schedule of the same shape as ``per_block`` (mean removals per block) scaled to
    ``target_gflops``: counts ``round(m * per_block[l])`` (each leaving at least 4 patch tokens),
    with the factor ``m`` found by bisection. For a policy whose own work adds FLOPs (the actor's),
    this is the dense oracle at its realized GFLOPs, the policy's FLOPs included."""
    n0 = backbone_cost(model).num_patches

    def counts(m):
        n, ks = n0, {}
        for l in sorted(per_block):
            ks[l] = max(0, min(int(round(m * per_block[l])), n - 4))
            n -= ks[l]
        return ks

    lo, hi = 0.0, 1.0
    while oracle_gflops(model, counts(hi)) > target_gflops and hi < 64:
        hi *= 2
    for _ in range(40):  # GFLOPs fall as m grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if oracle_gflops(model, counts(mid)) > target_gflops else (lo, mid)
    return min((counts(lo), counts(hi)), key=lambda ks: abs(oracle_gflops(model, ks) - target_gflops))


def gate_forced_actor(model, blocks: List[int]) -> Actor:
    """An untrained actor whose gate opens exactly at ``blocks`` (budgets and tokens still chosen by
    its random budget head and selector): hidden unit 0 of the gate reads gate-embedding channel 0,
    set to 10 at those blocks only."""
    actor = Actor.for_model(model)
    with torch.no_grad():
        hidden, out = actor.gate_mlp[0], actor.gate_mlp[2]
        hidden.weight.zero_()
        hidden.bias.zero_()
        hidden.weight[0, actor.embed_dim] = 1.0
        actor.gate_embed.zero_()
        actor.gate_embed[blocks, 0] = 10.0
        out.weight.zero_()
        out.weight[0, 0] = 10.0
        out.bias.fill_(-5.0)
    return actor


def oracle_forward(model, ks: Dict[int, int], patch_embed: Optional[Callable] = None):
    """Dense static schedule: the same blocks' own submodules, tokens dropped by slicing;
    ``patch_embed``: instead of the model's own (e.g. the engine's matrix-product form)."""
    embed = model.patch_embed if patch_embed is None else patch_embed

    def fwd(x):
        x = model.norm_pre(model.patch_drop(model._pos_embed(embed(x))))
        for l, blk in enumerate(model.blocks):
            x = x + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x))))
            if ks.get(l):
                x = x[:, : x.shape[1] - ks[l]]
            x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
        return model.forward_head(model.norm(x))

    return fwd


def captured(fn: Callable, example: torch.Tensor) -> Callable:
    """``fn`` on a fixed-shape batch as one CUDA graph (input copied into a fixed buffer, output
    cloned): the launch-free ceiling of a static schedule."""
    from timm_dora.engine.graphs import capture_stream

    static_in = example.clone()
    side = capture_stream(example.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        fn(static_in)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g, stream=side):  # (as timm_dora.engine.graphs: one cuBLAS
        static_out = fn(static_in)  # workspace for all captures, not one more stream's)

    def replay(x):
        static_in.copy_(x)
        g.replay()
        return static_out.clone()

    return replay


def time_forward(fn: Callable, inputs: List[torch.Tensor], warmup: int, iters: int, repeats: int):
    """The App. E.5 protocol of :func:`timm_dora.evaluate.bench.time_forward`, keeping the fields of
    ``throughput``'s rows."""
    r = bench.time_forward(fn, inputs, warmup=warmup, iters=iters, repeats=repeats)
    keep = ("ms_per_batch", "images_per_s", "repeats_images_per_s", "warmup_peak_memory_mib", "steady_peak_memory_mib")
    return {k: r[k] for k in keep if k in r}


def measure_row(fn: Callable, inputs: List[torch.Tensor], warmup: int, iters: int, repeats: int):
    """One row: :func:`time_forward` and, on CUDA, the row's memory (see ``benchmarks/throughput.py``'s
    docstring): the peaks over the whole row and after the first warm-up, the reserved peak, what was
    allocated when the row started and the peaks above it. Collects garbage and empties the allocator's
    cache first (graphs of unwrapped rows hold memory pools until collected)."""
    cuda = inputs[0].device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    r = time_forward(fn, inputs, warmup, iters, repeats)
    if cuda:
        # over the whole row (captures of new sizes included) and after the first warm-up
        r["peak_memory_mib"] = max(r["warmup_peak_memory_mib"], r["steady_peak_memory_mib"])
        # CUDA graphs allocate their pools once, at capture; the reserved peak (cache emptied
        # before the row, reset after the first warm-up) counts them
        r["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        # what the row's forwards add to what was allocated when it started: the model, its
        # inputs and what earlier rows left (the cuBLAS workspace of the graph captures' stream,
        # allocated once per process) are in base_memory_mib
        r["base_memory_mib"] = base
        r["peak_over_base_mib"] = r["peak_memory_mib"] - base
        r["steady_peak_over_base_mib"] = r["steady_peak_memory_mib"] - base
    return r


# ------------------------------------------------------------ engine settings of the graph rows
def graph_variants(args, graphs: bool, run_ahead: bool = True):
    """The engine options a row is measured under (``EngineOptions`` fields), with its name suffix:
    for ``*_graphs`` rows every combination of ``--run-ahead`` (only where ``run_ahead``: the
    actor's rows), ``--mlp-chunks`` and ``--reserve-pool`` (and ``--fused-interventions`` where the
    script has it); a setting given once adds no suffix (several: an A/B in one run, suffix
    ``[name=value]``)."""
    if not graphs:
        return [("", {})]
    dims = [("mlp_chunks", args.mlp_chunks, int), ("reserve_pool", args.reserve_pool, lambda v: v == "on")]
    if run_ahead:
        dims.insert(0, ("run_ahead", args.run_ahead, lambda v: v == "on"))
    base = {"fused_interventions": args.fused_interventions == "on"} if hasattr(args, "fused_interventions") else {}
    out = [("", base)]
    for name, values, convert in dims:
        out = [(sfx + (f"[{name}={v}]" if len(values) > 1 else ""), {**settings, name: convert(v)})
               for sfx, settings in out for v in values]
    return out


_ROW_OPTIONS = contextlib.ExitStack()


def apply(settings: dict) -> None:
    """Measure what follows under ``settings`` (``EngineOptions`` fields over the defaults): the
    active engine options of every model wrapped without options, until the next call; ``{}``:
    the defaults again."""
    _ROW_OPTIONS.close()
    if settings:
        _ROW_OPTIONS.enter_context(using(EngineOptions(**settings)))


# ------------------------------------------------ default_speed / small_batch configurations
VIT = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
DEIT_TI = "deit_tiny_patch16_224.fb_in1k"
DEIT_B = "deit_base_patch16_224"


def timed(fn: Callable, inputs: List[torch.Tensor], args) -> float:
    gc.collect()
    torch.cuda.empty_cache()
    return bench.time_forward(fn, inputs, warmup=args.warmup, iters=args.iters, repeats=args.repeats)["images_per_s"]


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The arguments ``default_speed`` and ``small_batch`` share: the ViT-Ti weights and images, the
    timing protocol, the output."""
    ap.add_argument("--vit-weights", required=True)
    ap.add_argument("--data", required=True, help="labels CSV with a test split")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)


def header(dev, script: str, argv, args, **protocol) -> Dict[str, Any]:
    """A result file's device, versions, command (``script``: the module's name, e.g.
    ``"default_speed"``; :func:`command_line`) and timing protocol."""
    return {**environment(dev, command_line(script, argv)),
            "protocol": {"warmup": args.warmup, "iters": args.iters, "repeats": args.repeats, "dtype": "bfloat16",
                         **protocol}}


def vit_published(args, dev, dtype, name: str = VIT, weights: Optional[str] = None):
    """``vit_tiny_published``: ViT-Ti with ``--vit-weights`` and the actor in hub/ (or ``name``'s)."""
    model = load_model(name, weights or args.vit_weights).to(dev, dtype).eval()
    return model, resolve_actor(model).to(dev, dtype)


# the published-actor configurations: backbone and the argument naming its weights
PUBLISHED = {"vit_tiny_published": (VIT, "vit_weights"), "deit_tiny_published": (DEIT_TI, "deit_weights")}


def published(ap, config: str, args, dev, dtype):
    """A configuration of :data:`PUBLISHED`: its backbone with the weights its option names and its
    actor in hub/ (:func:`vit_published`); a usage error through ``ap`` when the option is missing."""
    name, dest = PUBLISHED[config]
    if not getattr(args, dest, None):
        ap.error(f"{config} needs --{dest.replace('_', '-')}")
    return vit_published(args, dev, dtype, name, getattr(args, dest))


def deit_forced(dev, dtype):
    """``deit_base_forced_369``: DeiT-B with random weights, a random actor whose gate is forced
    open at blocks 3, 6 and 9, and ``make(b)``: two batches of ``b`` random images."""
    torch.manual_seed(0)
    model = load_model(DEIT_B, random_weights=True).to(dev, dtype).eval()
    forced = gate_forced_actor(model, [3, 6, 9]).to(dev, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    make = lambda b: [torch.randn(b, 3, 224, 224, device=dev, generator=g).to(dtype) for _ in range(2)]
    return model, forced, make


# ------------------------------------------------------------------- the pool's paired studies
# the default partition of sample1000: all 1,000 images
POOL = ("rollout", "qc", "dev")


class ClsSimSelector(RecordedSelector):
    """The static baseline's rule as a substitution: the visual tokens whose key (heads
    concatenated) is least cosine-similar to the CLS key go first."""

    name = "cls_sim"

    def scores(self, ctx, pad):
        p = ctx.packed.num_prefix
        k = F.normalize(pad.pad(ctx.keys.float()), dim=-1)
        return -(k[:, p:] * k[:, :1]).sum(-1), None


def paired(pred: torch.Tensor, native: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """``drop_pp`` (native's top-1 minus ``pred``'s), its standard error and the ``agreement`` with
    native, in percent, rounded to two decimals (the pool studies' rows)."""
    d = (native == labels).float() - (pred == labels).float()
    return {"drop_pp": round(d.mean().item() * 100, 2), "drop_se_pp": round(d.std().item() / len(d) ** 0.5 * 100, 2),
            "agreement": round((pred == native).float().mean().item() * 100, 2)}


# ------------------------------------------------------------------------ paired accuracy rows
# every DORA row (seeds, the published seed beside its random selector, checkpoints) runs as
# timm_dora.wrap(model) does by default: captured on CUDA wherever it can be (eager on the CPU and
# with skip_dead). The eager and captured executors run different kernels, so in bf16 a few near-tie
# decisions differ between them (a DeiT-Ti actor's `test` drop read 1.08 pp captured, 0.92 eager):
# one executor for all rows keeps the seeds comparable (tradeoff, choose_seed and seen_unseen all use it).
CUDA_GRAPHS = None


def preload_batches(model, data: str, splits: Sequence[str], dev, dtype, batch: int, workers: int,
                    limit: Optional[int] = None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The images of ``splits`` (in that order; the first ``limit`` of each), preprocessed once and
    kept on the device."""
    return [(x.to(dev, dtype), torch.as_tensor(y).to(dev)) for split in splits
            for x, y, *_ in loader_for(model, data, split, batch=batch, workers=workers, limit=limit)]


@torch.inference_mode()
def predict(method, batches) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Per row of ``method``: top-1 predictions and per-image GFLOPs over all images."""
    out: Dict[str, Tuple[list, list]] = {}
    try:
        for x, _ in batches:
            for name, o in method.outputs(x).items():
                p, g = out.setdefault(name, ([], []))
                p.append(o.logits.float().argmax(1))
                g.append(o.gflops.double())
    finally:
        method.close()
    return {k: (torch.cat(p), torch.cat(g)) for k, (p, g) in out.items()}


def paired_gap(pred: torch.Tensor, other: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """How much more ``pred`` drops than ``other`` on the same images (``other``'s top-1 minus
    ``pred``'s, pp; equal to the difference of their ``drop_pp``) and the standard error of that
    per-image difference: the comparison of two methods with the images' shared noise taken out."""
    diff = (other == labels).double() - (pred == labels).double()  # per image in {-1, 0, 1}
    n = diff.numel()
    return {"drop_gap_pp": 100.0 * float(diff.mean()), "drop_gap_se_pp": 100.0 * float(diff.std(unbiased=False)) / n ** 0.5}


def paired_row(pred: torch.Tensor, gfl: torch.Tensor, native_pred: torch.Tensor, labels: torch.Tensor,
               native_gflops: float, spread: bool = False) -> Dict[str, Any]:
    """A method's row paired against native on the same images: ``top1``, ``drop_pp`` and its paired
    ``drop_se_pp`` (:func:`paired_gap` to native), ``agreement`` with native, mean ``gflops`` and
    ``gflops_reduction_pct``; with ``spread``, the per-image ``gflops_p10`` / ``gflops_p90`` and
    ``spread_pct_of_native``."""
    gap = paired_gap(pred, native_pred, labels)  # the drop is the gap to native
    row = {"top1": 100.0 * float((pred == labels).double().mean()), "drop_pp": gap["drop_gap_pp"],
           "drop_se_pp": gap["drop_gap_se_pp"],
           "agreement": 100.0 * float((pred == native_pred).double().mean()),
           "gflops": float(gfl.mean()), "gflops_reduction_pct": 100.0 * (1.0 - float(gfl.mean()) / native_gflops)}
    if spread:
        q = torch.quantile(gfl.float().cpu(), torch.tensor([0.1, 0.9]))
        row.update(gflops_p10=float(q[0]), gflops_p90=float(q[1]),
                   spread_pct_of_native=100.0 * float(q[1] - q[0]) / native_gflops)
    return row


def rounded(obj: Any, digits: int = 6) -> Any:
    """``obj`` with every float rounded to ``digits`` significant digits (the JSON records: a drop's
    standard error is 0.5 pp, so the digits past the sixth are noise that only takes space)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    return obj


def interpolate(points: Sequence[Tuple[float, float]], at: float) -> Optional[float]:
    """The drop of a sweep ``[(gflops, drop), ...]`` linearly interpolated at ``at`` GFLOPs
    (``None`` outside the sweep's range)."""
    pts = sorted(points)
    for (g0, d0), (g1, d1) in zip(pts, pts[1:]):
        if g0 <= at <= g1:
            return d0 if g1 == g0 else d0 + (d1 - d0) * (at - g0) / (g1 - g0)
    return None


def native_row(model, batches, labels: torch.Tensor, skip_dead: bool = False) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Native's top-1 predictions over ``batches`` and its row (``top1``, mean ``gflops``)."""
    nat_p, nat_g = predict(build_method(model, "native", skip_dead=skip_dead), batches)["native"]
    return nat_p, {"top1": 100.0 * float((nat_p == labels).double().mean()), "gflops": float(nat_g.mean())}


# ---------------------------------------------------------------------------------- replay plans
def random_plan(batch: int, n0: int, depth: int, blocks: Sequence[int], seed: int = 0, min_keep: int = 4):
    """Random deletions varied per image: per block, each image removes 0..(N-min_keep) tokens."""
    g = torch.Generator().manual_seed(seed)
    n = [n0] * batch
    plan: Dict[int, tuple] = {}
    for l in blocks:
        imgs, cols = [], []
        for i in range(batch):
            k = int(torch.randint(0, max(n[i] - min_keep, 0) + 1, (1,), generator=g))
            chosen = torch.randperm(n[i], generator=g)[:k]
            imgs += [i] * k
            cols += chosen.tolist()
            n[i] -= k
        plan[l] = (torch.tensor(imgs, dtype=torch.long), torch.tensor(cols, dtype=torch.long))
    return plan


class Recorder:
    """Wraps a policy and records its deletions as a replay plan (image, column) per block."""

    def __init__(self, policy):
        self.policy = policy
        self.plan: Dict[int, tuple] = {}
        self.contexts = []

    def __call__(self, ctx):
        dec = self.policy(ctx)
        self.contexts.append(ctx)
        if dec.remove is not None:
            rows = dec.remove.nonzero().squeeze(1)
            img = ctx.packed.seg[rows]
            col = ctx.packed.pos[rows] - ctx.packed.num_prefix
            self.plan[ctx.block] = (img, col)
        return dec


def recorded_plan(model, policy, x):
    """The replay plan of ``policy``'s deletions on ``x`` (one forward of the wrapped ``model``,
    unwrapped afterwards)."""
    rec = Recorder(policy)
    timm_dora.wrap(model, policy=rec)
    try:
        with torch.inference_mode():
            model(x)
    finally:
        timm_dora.unwrap(model)
    return rec.plan
