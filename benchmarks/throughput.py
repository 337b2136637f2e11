"""Throughput benchmark following the paper's App. E.5 protocol (not a test).

GPU-resident preprocessed inputs (random images: throughput does not depend on pixel or weight
values), bf16 weights and activations, batch 320, ``--batches`` distinct batches cycled, per repeat
200 warm-up and 200 timed forwards with a CUDA synchronisation right before and after the timed
loop, 5 repeats, median (:func:`timm_dora.evaluate.bench.time_forward`). Configurations per backbone:

- ``native``: the unwrapped timm model (its fused SDPA attention).
- ``gate_off``: wrapped with an actor whose gate never opens (the actor's gate runs every block).
- ``gate_off_spec``: the same with ``speculate=True`` (each block's MLP is enqueued before the
  host reads the gate, so the GPU queue does not drain at the read).
- ``gate_off_graphs``: the same with ``cuda_graphs=True`` (the whole forward stays dense: every
  segment replayed from CUDA graphs, the MLP enqueued before each gate read).
- ``fixed``: wrapped with a fixed replay policy with per-image variable budgets at fixed blocks
  (deletion, compaction, packing and varlen attention, no actor), one per ``--reductions`` target.
- ``fixed_graphs``: the same with ``cuda_graphs=True`` (graphs until the first deletion).
- ``actor``: wrapped with a random-weight actor whose gate is forced open at the same blocks as the
  fixed policy (all of DORA's inference work: gate, controller, selection, packing).
- ``actor_spec``: the same with ``speculate=True`` (the speculative MLP is wasted at the blocks
  where the gate opens; its FLOPs are not in the row's GFLOPs).
- ``actor_graphs``: the same with ``cuda_graphs=True``.
- ``oracle``: a dense run with a static schedule removing the fixed policy's mean count at the
  same blocks (``x[:, :n]`` slicing, zero selection or packing overhead): the ceiling at equal
  GFLOPs.
- ``oracle_graphs``: the same static schedule captured as one CUDA graph (CUDA only): no launch
  overhead at all, the ceiling for the ``*_graphs`` rows (the eager ``oracle`` is itself
  launch-bound on small backbones).
- ``actor_oracle`` / ``actor_oracle_graphs``: the same two at the actor rows' realized mean GFLOPs,
  the actor's own FLOPs included (its removals per block scaled until the GFLOPs match,
  :func:`matched_counts`): the ceiling for the ``actor*`` rows at equal GFLOPs.

Each row also records on CUDA ``peak_memory_mib``, the peak allocated memory over the whole row
(weights and the cycled input batches included, so rows of one backbone compare; graph rows'
captures included: a capture's warm-up runs outside the graphs' pool), ``steady_peak_memory_mib``,
the same after the first warm-up (every batch seen, every graph captured: what serving costs), and
``peak_reserved_mib``, the peak memory reserved by the allocator after the first warm-up (the
cache is emptied before each row; the graphs' pools count here). ``base_memory_mib`` is what was
allocated when the row started (the model, the inputs, and what earlier rows left: the first graph
capture of a process leaves cuBLAS's workspace for the capture stream, 33 MiB on the H100, in
every later row), and ``peak_over_base_mib`` / ``steady_peak_over_base_mib`` the two peaks above
it: what the row's own forwards add (the actor's weights, allocated before the row, not included).

Usage (prints a table; writes JSON with device, versions and the command):

    python benchmarks/throughput.py --models deit_base_patch16_224 vit_tiny_patch16_224 \
        --out benchmarks/results/throughput_h100.json
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import timm  # noqa: E402

import timm_dora  # noqa: E402
import timm_dora.engine.graphs  # noqa: E402
import timm_dora.engine.segments  # noqa: E402
from timm_dora import Actor, ActorPolicy, ReplayPolicy  # noqa: E402
from timm_dora.evaluate import bench  # noqa: E402
from timm_dora.evaluate import environment, write_json  # noqa: E402
from timm_dora.engine.flops import backbone_cost  # noqa: E402


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


def parse_reduction(target: str, default_blocks: List[int]):
    """``"0.55@1,4,7"`` -> ``(0.55, [1, 4, 7])``; ``"0.38"`` -> ``(0.38, default_blocks)``."""
    red, _, blocks = str(target).partition("@")
    try:
        value = float(red)
        chosen = [int(b) for b in blocks.split(",")] if blocks else list(default_blocks)
    except ValueError:
        raise SystemExit(f"--reductions: {target!r} is not R or R@b,b,... (e.g. 0.55@1,4,7)") from None
    if not 0 < value < 1:
        raise SystemExit(f"--reductions: {target!r}: the reduction must be in (0, 1)")
    return value, chosen


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


def static_counts(stats, blocks: List[int]) -> Dict[int, int]:
    """The oracle's removal count per block: the fixed policy's mean count there, rounded."""
    per_block = stats.removed.float().mean(0)
    return {l: int(round(float(per_block[l]))) for l in blocks}


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
    from timm_dora.engine.segments import _side_stream

    static_in = example.clone()
    side = _side_stream(example.device)
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
    """The App. E.5 protocol of :func:`timm_dora.evaluate.bench.time_forward`, keeping this script's row fields."""
    r = bench.time_forward(fn, inputs, warmup=warmup, iters=iters, repeats=repeats)
    keep = ("ms_per_batch", "images_per_s", "repeats_images_per_s", "warmup_peak_memory_mib", "steady_peak_memory_mib")
    return {k: r[k] for k in keep if k in r}


def measure_row(fn: Callable, inputs: List[torch.Tensor], warmup: int, iters: int, repeats: int):
    """One row: :func:`time_forward` and, on CUDA, the row's memory (see the module docstring): the
    peaks over the whole row and after the first warm-up, the reserved peak, what was allocated
    when the row started and the peaks above it. Collects garbage and empties the allocator's
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


def gflops_of(model, plan, inputs):
    timm_dora.set_policy(model, ReplayPolicy(plan, check=False))
    with torch.inference_mode():
        model(inputs[0])
    return model.dora_stats


def graph_variants(args, graphs: bool, run_ahead: bool = True):
    """The module settings a row is measured under, with its name suffix: for ``*_graphs`` rows
    every combination of ``--run-ahead`` (only where ``run_ahead``: the actor's rows),
    ``--mlp-chunks`` and ``--reserve-pool``; a setting given once adds no suffix (several: an A/B
    in one run, suffix ``[name=value]``)."""
    if not graphs:
        return [("", {})]
    dims = [("mlp_chunks", "MLP_CHUNKS", args.mlp_chunks, int),
            ("reserve_pool", "RESERVE_POOL", args.reserve_pool, lambda v: v == "on")]
    if run_ahead:
        dims.insert(0, ("run_ahead", "RUN_AHEAD", args.run_ahead, lambda v: v == "on"))
    out = [("", {})]
    for name, flag, values, convert in dims:
        out = [(sfx + (f"[{name}={v}]" if len(values) > 1 else ""), {**settings, flag: convert(v)})
               for sfx, settings in out for v in values]
    return out


def setting_home(name: str):
    """The engine module that holds the setting ``name``."""
    return timm_dora.engine.segments if name in ("MLP_CHUNKS", "RESERVE_POOL") else timm_dora.engine.graphs


def apply(settings: dict) -> None:
    for name, value in settings.items():
        setattr(setting_home(name), name, value)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["deit_base_patch16_224", "vit_tiny_patch16_224"])
    ap.add_argument("--batch", type=int, default=320)
    ap.add_argument("--batches", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reductions", nargs="+", default=["0.38", "0.55@1,4,7"],
                    help="GFLOPs reduction targets, each optionally with its own pruning blocks "
                         "(R@b,b,b; default --blocks): at blocks 3, 6, 9 at most ~46 %% is reachable")
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--spread", type=int, default=16, help="per-image budget spread around the mean")
    ap.add_argument("--configs", nargs="+",
                    default=["native", "gate_off", "gate_off_spec", "gate_off_graphs", "fixed", "fixed_graphs",
                             "actor", "actor_spec", "actor_graphs", "oracle", "oracle_graphs",
                             "actor_oracle", "actor_oracle_graphs"])
    ap.add_argument("--attn-backends", nargs="+", default=["auto"],
                    help="the wrapped rows once per attention backend (a config gets the suffix [backend] "
                         "when more than one is given: an A/B in one run)")
    ap.add_argument("--controllers", nargs="+", default=["auto"], choices=["auto", "modules"],
                    help="the actor rows once per controller: auto (the fused Triton kernels where the triton "
                         "backend runs) and/or modules (fused_controller=False); suffix [c] when more than one")
    ap.add_argument("--fused-interventions", choices=["on", "off"], default="on",
                    help="timm_dora.engine.graphs.FUSED_INTERVENTIONS for the *_graphs rows (the actor's controller in "
                         "its block's attention graph; NOTES change 32)")
    ap.add_argument("--run-ahead", nargs="+", choices=["on", "off"], default=["on"],
                    help="timm_dora.engine.graphs.RUN_AHEAD for the gate-off and actor *_graphs rows (the dense "
                         "blocks before the first open gate as one graph; NOTES change 37); both: an A/B in "
                         "one run, suffix [run_ahead=...]")
    ap.add_argument("--mlp-chunks", nargs="+", type=int, default=[1],
                    help="timm_dora.engine.segments.MLP_CHUNKS for the *_graphs rows (each graph's MLP in this many row "
                         "chunks: a smaller memory pool); several: an A/B in one run, suffix [mlp_chunks=...]")
    ap.add_argument("--reserve-pool", nargs="+", choices=["on", "off"], default=["on"],
                    help="timm_dora.engine.segments.RESERVE_POOL for the *_graphs rows (one segment of the graphs' memory "
                         "pool reserved before the first capture; NOTES change 39); both: suffix [reserve_pool=...]")
    ap.add_argument("--img-size", type=int, default=None, help="override the model's input size (smoke tests)")
    ap.add_argument("--device", default="cuda", help="cuda for real numbers; cpu only to smoke-test the script")
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args(argv)
    flags = ("FUSED_INTERVENTIONS", "RUN_AHEAD", "MLP_CHUNKS", "RESERVE_POOL")
    saved = {f: getattr(setting_home(f), f) for f in flags}
    timm_dora.engine.graphs.FUSED_INTERVENTIONS = args.fused_interventions == "on"
    try:
        return _measure(args, argv)
    finally:  # (module settings: a caller in the same process gets its own back)
        apply(saved)


def _measure(args, argv) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {
        **environment(dev, " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))),
        "protocol": {k: getattr(args, k) for k in ("batch", "batches", "warmup", "iters", "repeats")},
        "dtype": str(dtype).replace("torch.", ""),
        "rows": [],
    }
    for name in args.models:
        torch.manual_seed(0)
        kw = {} if args.img_size is None else {"img_size": args.img_size}
        model = timm.create_model(name, pretrained=False, **kw).eval().to(dev, dtype)
        cost = backbone_cost(model)
        native_gflops = 2 * cost.native_macs() / 1e9
        inputs = [torch.randn(args.batch, 3, *model.patch_embed.img_size, device=dev, dtype=dtype) for _ in range(args.batches)]
        rows = results["rows"]  # written out after every row (a run cut short keeps what it measured)

        def failed(config, e):
            """Record a failing configuration (the others' numbers must not be lost)."""
            rows.append({"model": name, "config": config, "error": f"{type(e).__name__}: {e}"})
            write_json(args.out, results)
            print(f"{name:28s} {config:22s} FAILED: {type(e).__name__}: {e}", flush=True)

        def add(config, fn, gflops, **extra):
            try:
                r = measure_row(fn, inputs, args.warmup, args.iters, args.repeats)
            except Exception as e:
                failed(config, e)
                return
            row = {"model": name, "config": config, "gflops": gflops, **extra, **r}
            rows.append(row)
            write_json(args.out, results)
            print(f"{name:28s} {config:22s} {gflops:8.3f} GFLOPs {r['images_per_s']:10.1f} img/s {r['ms_per_batch']:8.3f} ms/batch", flush=True)

        def first_forward(wrapped, config):
            """One forward for the row's statistics; a failure is recorded (and the model unwrapped)."""
            try:
                with torch.inference_mode():
                    wrapped(inputs[0])
                return True
            except Exception as e:
                failed(config, e)
                timm_dora.unwrap(wrapped)
                return False

        if "native" in args.configs:
            add("native", model, native_gflops)
        actor = Actor.for_model(model).to(dev, dtype)
        with torch.no_grad():
            actor.gate_mlp[2].bias.fill_(-1e4)
        for ab in args.attn_backends:
            sfx = "" if len(args.attn_backends) == 1 else f"[{ab}]"
            for config, speculate, graphs in (("gate_off", False, False), ("gate_off_spec", True, False),
                                              ("gate_off_graphs", False, True)):
                if config not in args.configs:
                    continue
                for vsfx, settings in graph_variants(args, graphs):
                    apply(settings)
                    row_name = config + sfx + vsfx
                    timm_dora.wrap(model, actor, speculate=speculate, cuda_graphs=graphs, attn_backend=ab)
                    if not first_forward(model, row_name):
                        continue
                    add(row_name, model, float(model.dora_stats.gflops.mean()), backend=model.dora_stats.backend)
                    timm_dora.unwrap(model)
        for target in args.reductions:
            red, blocks = parse_reduction(target, args.blocks)
            mean_k = schedule_for_reduction(model, red, blocks)
            plan = fixed_plan(args.batch, cost.num_patches, blocks, mean_k, args.spread, 0, dev)
            timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=False)
            stats = gflops_of(model, plan, inputs)
            g = float(stats.gflops.mean())
            tag = f"@{int(round(100 * (1 - g / native_gflops)))}%"
            timm_dora.unwrap(model)
            forced = gate_forced_actor(model, blocks).to(dev, dtype)  # one actor: equal decisions
            actor_stats = None  # the forced actor's statistics (equal in all its rows): its oracle's input
            for ab in args.attn_backends:
                sfx = "" if len(args.attn_backends) == 1 else f"[{ab}]"
                if "fixed" in args.configs:
                    timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), attn_backend=ab, cuda_graphs=False)
                    if first_forward(model, "fixed" + tag + sfx):
                        add("fixed" + tag + sfx, model, g, backend=model.dora_stats.backend, blocks=blocks,
                            mean_k=mean_k, tokens_range=[int(stats.tokens[:, -1].min()), int(stats.tokens[:, -1].max())])
                        timm_dora.unwrap(model)
                for vsfx, settings in graph_variants(args, True, run_ahead=False) if "fixed_graphs" in args.configs else []:
                    apply(settings)
                    row_name = "fixed_graphs" + tag + sfx + vsfx
                    timm_dora.wrap(model, policy=ReplayPolicy(plan, check=False), cuda_graphs=True, attn_backend=ab)
                    if first_forward(model, row_name):
                        add(row_name, model, g, backend=model.dora_stats.backend, blocks=blocks, mean_k=mean_k)
                        timm_dora.unwrap(model)
                for config, speculate, graphs in (("actor", False, False), ("actor_spec", True, False),
                                                  ("actor_graphs", False, True)):
                    if config not in args.configs:
                        continue
                    for ctl, (vsfx, settings) in [(c, v) for c in args.controllers for v in graph_variants(args, graphs)]:
                        csfx = sfx + ("" if len(args.controllers) == 1 else f"[{ctl}]") + vsfx
                        apply(settings)
                        policy = ActorPolicy(forced, speculate=speculate, fused_controller=None if ctl == "auto" else False)
                        timm_dora.wrap(model, policy=policy, cuda_graphs=graphs, attn_backend=ab)
                        if not first_forward(model, config + tag + csfx):
                            continue
                        s = actor_stats = model.dora_stats
                        add(config + "(random)" + tag + csfx, model, float(s.gflops.mean()), backend=s.backend,
                            gate_rate=s.gate.float().mean(0).tolist(), policy_gflops=float(s.policy_gflops.mean()))
                        timm_dora.unwrap(model)
            ks = static_counts(stats, blocks)
            fwd = oracle_forward(model, ks)
            if "oracle" in args.configs:
                add("oracle" + tag, fwd, oracle_gflops(model, ks), static_k=ks)
            if "oracle_graphs" in args.configs and dev.type == "cuda":
                add("oracle_graphs" + tag, captured(fwd, inputs[0]), oracle_gflops(model, ks), static_k=ks)
            if {"actor_oracle", "actor_oracle_graphs"} & set(args.configs) and actor_stats is None:
                failed("oracle(actor)" + tag, RuntimeError("needs an actor row (actor, actor_spec or actor_graphs)"))
            elif {"actor_oracle", "actor_oracle_graphs"} & set(args.configs):
                # the dense oracle at the actor's realized GFLOPs (its own FLOPs included), its
                # removals spread over the blocks like the actor's
                removed = actor_stats.removed.float().mean(0)
                ks = matched_counts(model, {l: float(removed[l]) for l in blocks}, float(actor_stats.gflops.mean()))
                fwd = oracle_forward(model, ks)
                if "actor_oracle" in args.configs:
                    add("oracle(actor)" + tag, fwd, oracle_gflops(model, ks), static_k=ks)
                if "actor_oracle_graphs" in args.configs and dev.type == "cuda":
                    add("oracle_graphs(actor)" + tag, captured(fwd, inputs[0]), oracle_gflops(model, ks), static_k=ks)
        del model, inputs
        torch.cuda.empty_cache()
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
