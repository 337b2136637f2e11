"""An actor that starts where a static schedule is: the warm start for ``timm-dora-train --init-actor`` (ours).

Every DORA policy trained on DeiT-Ti so far settled on a few pruning blocks (the published one: blocks
0, 7 and 11 for every image), while the static rules do best spread over every block (on ``test`` at
-35 % GFLOPs: 1.54 pp every block against 3.85 pp at blocks 3/6/9). The issue's lever "initialisation
from a good static schedule" asks whether PPO started from such a gradual schedule finds a better
policy than from a random actor. This script makes that start by imitation, no labels read:

- **gate**: open (probability ``--open``) at the schedule's blocks and closed (``1 - open``) at the
  others, for every image: a binary cross-entropy on the gate's own inputs (CLS key, block, history)
  along the schedule's trajectories; the soft targets leave the gate room to explore.
- **budget**: the schedule's count at every open step (cross-entropy on its grid index): the
  budget head sees no block index, so the schedule must remove the same count at each of its blocks.
- **selector**: the static rule's token order (``cls_sim``: least cosine-similar to the CLS key
  first; Plackett-Luce likelihood of the first ``k``), the distributions PPO trains.

    python -m benchmarks.static_init --model deit_tiny_patch16_224.fb_in1k --weights W.safetensors \\
        --data labels.csv --schedule 1:12,2:12,3:12,4:12,5:12,6:12,7:12,8:12,9:12,10:12,11:12 \\
        --width 64 --out runs/static_init
    timm-dora-train ... --init-actor runs/static_init

It learns from the ``--splits`` images (``rollout``, ``qc``) and reports on ``--eval-split`` (dev) how
closely the actor's deterministic decisions follow the schedule (gate, budget, shared removed tokens)
and both GFLOPs; the record goes into the actor's config (``training.static_init``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from timm_dora import data as D
from timm_dora.engine import run, wrap
from timm_dora.evaluate import load_model
from timm_dora.evaluate.baselines.static import parse_schedule
from timm_dora.hub import save_pretrained
from timm_dora.policy import Actor, ActorPolicy, NoPrune, encoder_sizes
from timm_dora.train.distill import removal_sets
from timm_dora.train.rollout import evaluate_controller
from benchmarks.common import ClsSimSelector  # (the static rule's scores)


class ClsSimSchedule(ClsSimSelector):
    """The static ``cls_sim`` rule as a policy (:class:`benchmarks.common.ClsSimSelector`'s scores: the same
    removals as the static baseline's), recording what an actor would observe at every block
    (``gate``) and at every removal (``steps``)."""

    def __init__(self, removed: torch.Tensor, actor: Actor):
        super().__init__(removed)
        self.actor = actor
        self.gate_rows: Dict[str, List[torch.Tensor]] = {"cls_key": [], "h": [], "block": [], "open": []}
        self.steps: Dict[str, List[torch.Tensor]] = {"keys": [], "lengths": [], "h": [], "block": [], "k": [], "order": []}

    def _history(self, ctx, rows=None) -> torch.Tensor:
        h = self.actor.history(ctx.n_visual, ctx.rho, ctx.interventions, num_patches=ctx.num_patches)
        return h if rows is None else h[rows]

    def __call__(self, ctx):
        packed, b = ctx.packed, ctx.packed.batch_size
        self.gate_rows["cls_key"].append(ctx.keys[packed.starts].float())
        self.gate_rows["h"].append(self._history(ctx))
        self.gate_rows["block"].append(torch.full((b,), ctx.block, dtype=torch.long))
        self.gate_rows["open"].append(self.gate[:, ctx.block].clone())  # (removed covers every block)
        return super().__call__(ctx)

    def scores(self, ctx, pad):
        s, _ = super().scores(ctx, pad)  # least similar to the CLS key first
        p = ctx.packed.num_prefix
        keys = pad.pad(ctx.keys.float())
        keys = torch.cat([keys[:, :1], keys[:, p:]], 1)  # the controller's input: CLS key, then visual keys
        valid = pad.valid[:, p:]
        k_rm = self.removed[pad.active, ctx.block]
        order = s.masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)[:, : int(k_rm.max())]
        self.steps["keys"].append(keys)
        self.steps["lengths"].append(valid.sum(1) + 1)
        self.steps["h"].append(self._history(ctx, pad.active))
        self.steps["block"].append(torch.full((pad.active.numel(),), ctx.block, dtype=torch.long))
        self.steps["k"].append(k_rm)
        self.steps["order"].append(order)
        return s, None


def schedule_counts(schedule: Dict[int, int], actor: Actor) -> int:
    """The one count every block of ``schedule`` removes (a clear error otherwise, or off the grid)."""
    counts = set(schedule.values())
    if len(counts) != 1:
        raise ValueError(f"static_init: the budget head sees no block index, so every block must remove the same count; got {sorted(counts)}")
    k = counts.pop()
    if k not in actor.budgets.tolist():
        raise ValueError(f"static_init: {k} tokens is not on the actor's budget grid (multiples of {actor.budget_step})")
    if any(not 0 <= b < actor.depth for b in schedule):
        raise ValueError(f"static_init: the schedule names a block outside 0..{actor.depth - 1}")
    return k


@torch.no_grad()
def collect(model, actor: Actor, removed: torch.Tensor, images: torch.Tensor, batch: int):
    """The schedule's trajectories over ``images``: the gate's rows and the padded removal steps."""
    gate: Dict[str, list] = {k: [] for k in ("cls_key", "h", "block", "open")}
    steps: Dict[str, list] = {k: [] for k in ("keys", "lengths", "h", "block", "k", "order")}
    for i in range(0, images.shape[0], batch):
        x = images[i:i + batch]
        policy = ClsSimSchedule(removed.expand(x.shape[0], -1), actor)
        run(model, x, policy)
        for k in gate:
            gate[k] += policy.gate_rows[k]
        for k in steps:
            steps[k] += policy.steps[k]
    width = max(t.shape[1] for t in steps["keys"])
    steps["keys"] = [F.pad(t, (0, 0, 0, width - t.shape[1])) for t in steps["keys"]]
    return {k: torch.cat(v) for k, v in gate.items()}, {k: torch.cat(v) for k, v in steps.items()}


def fit(actor: Actor, gate: Dict[str, torch.Tensor], steps: Dict[str, torch.Tensor], p_open: float, *,
        epochs: int, lr: float, batch: int, seed: int) -> Actor:
    """Imitation of the schedule (see the module): one Adam over every parameter, each epoch a pass
    over the gate rows and one over the removal steps, in random minibatches."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(actor.parameters(), lr=lr)
    target = torch.where(gate["open"], p_open, 1.0 - p_open)
    index = torch.searchsorted(actor.budgets, steps["k"])
    kmax = int(steps["k"].max())
    cols = torch.arange(kmax)
    valid = cols[None, :] < steps["k"][:, None]
    order = F.pad(steps["order"], (0, kmax - steps["order"].shape[1]))
    for _ in range(epochs):
        for idx in torch.randperm(target.numel(), generator=gen).split(batch):
            logit = actor.gate_logit(gate["cls_key"][idx], gate["h"][idx], gate["block"][idx])
            loss = F.binary_cross_entropy_with_logits(logit.float(), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        for idx in torch.randperm(index.numel(), generator=gen).split(batch):
            logp_b, _, logp_s, _ = evaluate_controller(actor, steps["keys"][idx], steps["lengths"][idx], steps["h"][idx],
                                                       steps["block"][idx], index[idx], order[idx], valid[idx])
            loss = -(logp_b.mean() + (logp_s / steps["k"][idx].float()).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return actor.eval()


@torch.no_grad()
def follows(model, actor: Actor, removed: torch.Tensor, images: torch.Tensor, batch: int) -> Dict[str, float]:
    """How the actor's deterministic decisions follow the schedule on ``images``: the share of
    (image, block) gates that agree, of the actor's removal steps with the schedule's count, of the
    schedule's removed tokens the actor removes too (where both remove), and both mean GFLOPs."""
    n = {"gates": 0, "same_gate": 0, "steps": 0, "same_k": 0, "removed": 0, "shared": 0}
    gflops = {"actor": 0.0, "schedule": 0.0}
    for i in range(0, images.shape[0], batch):
        x = images[i:i + batch]
        policy = ActorPolicy(actor, record=True)
        _, st = run(model, x, policy)
        static = ClsSimSchedule(removed.expand(x.shape[0], -1), actor)
        _, st_s = run(model, x, static)
        gflops["actor"] += float(st.gflops.sum())
        gflops["schedule"] += float(st_s.gflops.sum())
        n["gates"] += st.gate.numel()
        n["same_gate"] += int((st.gate == static.gate[:, : st.gate.shape[1]].expand_as(st.gate)).sum())
        mine = removal_sets(policy.records)
        for j, o in enumerate(static.steps["order"]):
            blk = int(static.steps["block"][j][0])
            active = torch.nonzero(static.removed[:, blk] > 0).squeeze(1).tolist()
            for row, img in enumerate(active):
                theirs = set(o[row, : int(static.steps["k"][j][row])].tolist())
                got = mine.get((blk, img))
                if got is None:
                    continue
                n["steps"] += 1
                n["same_k"] += len(got) == len(theirs)
                n["removed"] += len(theirs)
                n["shared"] += len(got & theirs)
    m = images.shape[0]
    return {"images": m, "same_gate_pct": 100.0 * n["same_gate"] / max(n["gates"], 1),
            "same_budget_pct": 100.0 * n["same_k"] / max(n["steps"], 1),
            "shared_removals_pct": 100.0 * n["shared"] / max(n["removed"], 1),
            "actor_gflops": gflops["actor"] / m, "schedule_gflops": gflops["schedule"] / m}


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default=None, help="backbone weights (.safetensors)")
    ap.add_argument("--data", required=True, help="labels CSV with a split column (labels are not read)")
    ap.add_argument("--schedule", required=True, help="block:count,... (one count for every block)")
    ap.add_argument("--open", type=float, default=0.9, help="the gate's target probability at the schedule's blocks")
    ap.add_argument("--width", type=int, default=64, help="the actor's encoder width (policy.encoder_sizes)")
    ap.add_argument("--splits", nargs="+", default=["rollout", "qc"], help="the images to learn from")
    ap.add_argument("--eval-split", default="dev")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--img-size", type=int, default=None, help="(smoke tests: a small random backbone)")
    ap.add_argument("--num-classes", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not 0.5 < args.open < 1.0:
        raise ValueError(f"static_init: --open must lie in (0.5, 1), got {args.open}")
    if args.eval_split in args.splits:
        raise ValueError(f"static_init: --eval-split {args.eval_split} is one of --splits: the report must be held out")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.weights, img_size=args.img_size, num_classes=args.num_classes).eval()
    actor = Actor.for_model(model, **encoder_sizes(args.width))
    schedule = parse_schedule(args.schedule)
    k = schedule_counts(schedule, actor)
    removed = torch.zeros(1, actor.depth, dtype=torch.long)
    removed[0, list(schedule)] = k
    ev = D.eval_transform(model)
    wrap(model, policy=NoPrune(), cuda_graphs=False)
    train_x = torch.cat([D.preload(D.open_split(args.data, s, ev), torch.device("cpu"))[0] for s in args.splits])
    eval_x = D.preload(D.open_split(args.data, args.eval_split, ev), torch.device("cpu"))[0]
    gate, steps = collect(model, actor, removed, train_x, batch=50)
    fit(actor, gate, steps, args.open, epochs=args.epochs, lr=args.lr, batch=args.batch, seed=args.seed)
    record = {"schedule": args.schedule, "rule": "cls_sim", "open": args.open, "width": args.width, "splits": args.splits,
              "epochs": args.epochs, "lr": args.lr, "batch": args.batch, "seed": args.seed,
              args.eval_split: follows(model, actor, removed, eval_x, batch=50)}
    save_pretrained(actor, args.out, backbone=model, extra={"model": args.model, "static_init": record})
    (Path(args.out) / "static_init.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record[args.eval_split]))
    return record


if __name__ == "__main__":
    main()
