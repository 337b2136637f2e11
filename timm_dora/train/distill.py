"""``timm-dora distill``: a narrower actor that makes a trained actor's decisions (ours).

On a Tiny backbone the paper's actor is not small: its encoder costs about 3.4 % of ViT-Ti's forward
per intervention (``policy.auto_width``), and every DORA row of a table counts it. A trained actor's
decisions can be kept at a fraction of that cost by imitation: the *student* (encoder width
``--width``, :func:`~timm_dora.policy.encoder_sizes`) takes the teacher's gate unchanged (its size
does not depend on the width, so its decisions are the teacher's exactly) and learns the teacher's
deterministic budget and token order on the teacher's own trajectories through the frozen backbone:
maximum likelihood of the teacher's budget index (cross-entropy) and of its removal order
(Plackett-Luce), the distributions PPO trains. No labels are read.

    timm-dora distill --model vit_tiny_patch16_224.augreg_in21k_ft_in1k --weights W.safetensors \\
        --data labels.csv --teacher timm_dora/hub/actors/vit_tiny_patch16_224.augreg_in21k_ft_in1k \\
        --width 64 --out runs/vit_tiny_w64_distilled

The held-out split (``--eval-split``, default ``dev``) reports how closely the student follows the
teacher on images it did not learn from (:func:`compare`: the same budget, the shared removed
tokens), and both actors' GFLOPs (mean, p10 and p90), agreement with the native model, top-1 and
paired drop. The student's config carries that dev record (``dev_top1``, ``dev_gflops``,
``dev_spread_pct``: p90 - p10 GFLOPs in % of native) and its teacher's training record
(``teacher``), so ``benchmarks/tradeoff.py`` can choose among distillation seeds on dev.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, Optional

import torch

from .. import data as D
from ..backbone import create_backbone
from ..engine import Packed, native_gflops, run, wrap
from ..hub import check_backbone, load_actor, save_pretrained
from ..policy import Actor, ActorPolicy, NoPrune, encoder_sizes
from .rollout import evaluate_controller

__all__ = ["distill", "teacher_steps", "compare", "removal_sets", "add_parser"]


@torch.no_grad()
def teacher_steps(model: torch.nn.Module, teacher: Actor, images: torch.Tensor, batch: int) -> Dict[str, torch.Tensor]:
    """Every gate-on step of the teacher's deterministic decisions (highest budget, highest scores)
    on ``images``, run in batches of ``batch``, with what it observed: one padded batch of the
    inputs of :func:`~timm_dora.train.rollout.evaluate_controller` (the policy's own step records;
    no native forward and no residual tokens, which PPO's ``collect`` keeps for the critic)."""
    steps: Dict[str, list] = {k: [] for k in ("keys", "lengths", "h", "block", "budget_index", "order", "valid")}
    for i in range(0, images.shape[0], batch):
        policy = ActorPolicy(teacher, record=True)
        run(model, images[i:i + batch], policy)
        for r in policy.records:
            if r.order is None:
                continue
            steps["keys"].append(Packed(r.ctrl_keys.float(), r.n_visual + 1, r.ctrl_lengths, 1).padded(1 + teacher.num_patches))
            steps["lengths"].append(r.n_visual + 1)
            steps["h"].append(r.h[r.active])
            steps["block"].append(torch.full_like(r.active, r.block))
            steps["budget_index"].append(r.budget_index)
            steps["order"].append(r.order)
            steps["valid"].append(r.valid)
    if not steps["order"]:
        raise ValueError("the teacher prunes none of the images: there are no decisions to learn")
    width = max(t.shape[1] for t in steps["order"])
    for name in ("order", "valid"):  # every step's selection padded to the widest (valid False there)
        steps[name] = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in steps[name]]
    return {k: torch.cat(v) for k, v in steps.items()}


def distill(model: torch.nn.Module, teacher: Actor, images: torch.Tensor, width: int, *, epochs: int = 30,
            lr: float = 1e-3, batch: int = 64, seed: int = 0, collect_batch: int = 64) -> Actor:
    """A width-``width`` student of ``teacher`` for the wrapped frozen ``model``, trained on the
    teacher's trajectories over ``images`` (see the module docstring)."""
    torch.manual_seed(seed)
    cfg = {**teacher.config(), **encoder_sizes(width)}
    student = Actor(**cfg).to(images.device)
    student.gate_embed.data.copy_(teacher.gate_embed)  # the gate: the teacher's own
    student.gate_mlp.load_state_dict(teacher.gate_mlp.state_dict())
    data = teacher_steps(model, teacher, images, collect_batch)
    n = data["lengths"].numel()
    params = [p for name, p in student.named_parameters() if not name.startswith("gate_")]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(n, generator=gen).split(batch):
            idx = idx.to(images.device)
            logp_b, _, logp_s, _ = evaluate_controller(student, data["keys"][idx], data["lengths"][idx], data["h"][idx],
                                                       data["block"][idx], data["budget_index"][idx],
                                                       data["order"][idx], data["valid"][idx])
            k = data["valid"][idx].sum(1).clamp_min(1).float()
            loss = -(logp_b.mean() + (logp_s / k).mean())  # the order's log-likelihood per removed token
            opt.zero_grad()
            loss.backward()
            opt.step()
    return student.eval()


def removal_sets(records) -> Dict[tuple, set]:
    """``{(block, image): the visual columns removed there}`` from an ``ActorPolicy(record=True)``
    forward's step records (columns among the image's visual tokens entering the block)."""
    return {(r.block, image): set(r.order[row][r.valid[row]].tolist())
            for r in records if r.order is not None for row, image in enumerate(r.active.tolist())}


@torch.no_grad()
def compare(model: torch.nn.Module, teacher: Actor, student: Actor, images: torch.Tensor,
            labels: Optional[torch.Tensor] = None, batch: int = 64) -> Dict:
    """Teacher and student on ``images``: the share of the teacher's gate-on steps where the
    student removes the same number of tokens, and the share of the teacher's removed tokens it
    removes too; each actor's mean GFLOPs and its 10th/90th percentiles over the images
    (``*_gflops_p10`` / ``*_gflops_p90``: the per-image spread), top-1 agreement with the native model and, with
    ``labels``, top-1 and paired drop (pp)."""
    acc = {"steps": 0, "same_k": 0, "removed": 0, "shared": 0}
    out = {name: {"gflops": [], "agree": 0, "correct": 0} for name in ("teacher", "student")}
    native_correct = 0
    for i in range(0, images.shape[0], batch):
        x = images[i:i + batch]
        native = run(model, x, NoPrune())[0].argmax(1)
        if labels is not None:
            native_correct += int((native == labels[i:i + batch]).sum())
        removed = {}
        for name, actor in (("teacher", teacher), ("student", student)):
            policy = ActorPolicy(actor, record=True)
            logits, stats = run(model, x, policy)
            pred = logits.argmax(1)
            out[name]["gflops"].append(stats.gflops.float().cpu())
            out[name]["agree"] += int((pred == native).sum())
            if labels is not None:
                out[name]["correct"] += int((pred == labels[i:i + batch]).sum())
            removed[name] = removal_sets(policy.records)
        for step, t in removed["teacher"].items():
            s = removed["student"].get(step, set())
            acc["steps"] += 1
            acc["same_k"] += len(s) == len(t)
            acc["removed"] += len(t)
            acc["shared"] += len(s & t)
    n = images.shape[0]
    res = {"images": n, "teacher_steps": acc["steps"],
           "same_budget_pct": 100.0 * acc["same_k"] / max(acc["steps"], 1),
           "shared_removals_pct": 100.0 * acc["shared"] / max(acc["removed"], 1)}
    for name, o in out.items():
        g = torch.cat(o["gflops"])
        res[f"{name}_gflops"] = float(g.sum()) / n
        res[f"{name}_gflops_p10"], res[f"{name}_gflops_p90"] = (float(q) for q in g.quantile(torch.tensor([0.1, 0.9])))
        res[f"{name}_agreement_pct"] = 100.0 * o["agree"] / n
        if labels is not None:
            res[f"{name}_top1"] = 100.0 * o["correct"] / n
            res[f"{name}_drop_pp"] = 100.0 * (native_correct - o["correct"]) / n
    if labels is not None:
        res["native_top1"] = 100.0 * native_correct / n
    return res


def add_parser(sub) -> None:
    ap = sub.add_parser("distill", help="a narrower actor that makes a trained actor's decisions (ours)",
                        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", default=None, help="backbone weights (.safetensors)")
    ap.add_argument("--data", required=True, help="labels CSV with a split column (labels are not read)")
    ap.add_argument("--teacher", required=True, help="the trained actor (folder or hf-hub:...)")
    ap.add_argument("--width", type=int, default=64, help="the student's encoder width (policy.encoder_sizes)")
    ap.add_argument("--splits", nargs="+", default=["rollout", "qc"], help="the images to learn from")
    ap.add_argument("--eval-split", default="dev", help="held-out images for the comparison")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64, help="controller steps per optimiser step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True, help="the student's folder (hub format)")
    ap.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    if args.eval_split in args.splits:
        raise ValueError(f"--eval-split {args.eval_split} is one of --splits: the comparison must be held out")
    model = create_backbone(args.model, args.weights).to(dev).eval()
    teacher, teacher_config = load_actor(args.teacher)
    check_backbone(teacher_config, model)
    teacher = teacher.to(dev).eval()
    encoder_sizes(args.width)  # a clear error for a width it cannot build
    ev = D.eval_transform(model)
    wrap(model, policy=NoPrune(), cuda_graphs=False, merge=teacher.merge)  # (the teacher's removals, as it trained)
    train_x = torch.cat([D.preload(D.open_split(args.data, s, ev), dev)[0] for s in args.splits])
    eval_x, eval_y = D.preload(D.open_split(args.data, args.eval_split, ev), dev)
    student = distill(model, teacher, train_x, args.width, epochs=args.epochs, lr=args.lr, batch=args.batch,
                      seed=args.seed)
    held_out = compare(model, teacher, student, eval_x, eval_y)
    learned = compare(model, teacher, student, train_x[:256])  # (no labels read for the learned images)
    record = {"distilled_from": str(args.teacher), "width": args.width, "splits": args.splits, "epochs": args.epochs,
              "lr": args.lr, "batch": args.batch, "seed": args.seed, args.eval_split: held_out, "learned_images": learned}
    out = Path(args.out)
    # the dev record that benchmarks/tradeoff.py selects seeds by, as timm-dora-train writes it, and
    # the per-image spread (p90 - p10 GFLOPs, % of native) that it requires where a record has it
    spread = 100.0 * (held_out["student_gflops_p90"] - held_out["student_gflops_p10"]) / native_gflops(model)
    extra = {"model": args.model, "dev_top1": held_out["student_top1"], "dev_native_top1": held_out["native_top1"],
             "dev_gflops": held_out["student_gflops"], "dev_spread_pct": spread, "distillation": record,
             "teacher": teacher_config.get("training")}  # the teacher's own training record (its provenance)
    save_pretrained(student.cpu(), out, backbone=model, extra=extra)
    (out / "distill.json").write_text(json.dumps(record, indent=1))
    print(f"{args.eval_split}: the student shares {held_out['shared_removals_pct']:.1f} % of the teacher's removed "
          f"tokens (the same budget at {held_out['same_budget_pct']:.1f} % of its steps); GFLOPs "
          f"{held_out['teacher_gflops']:.3f} -> {held_out['student_gflops']:.3f}; drop "
          f"{held_out['teacher_drop_pp']:.2f} -> {held_out['student_drop_pp']:.2f} pp -> {out}")
    return 0
