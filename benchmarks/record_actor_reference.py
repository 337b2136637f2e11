"""Record a published actor's decisions on a fixed slice of the test split (CPU, fp32).

    python -m benchmarks.record_actor_reference --model vit_tiny_patch16_224.augreg_in21k_ft_in1k \\
        --actor timm_dora/hub/actors/vit_tiny_patch16_224.augreg_in21k_ft_in1k --images 64 \\
        --out tests/data/actor_reference_vit_tiny.json

The first ``--images`` rows of the ``test`` split of ``../shared/data/imagenet-mini/labels.csv`` are
preprocessed with the backbone's eval transform and run native and wrapped (single thread, so the
numbers are reproducible). The JSON holds, per image, the label, both predictions, the gate and the
number of removed tokens per block and the GFLOPs; ``tests/test_published_actor.py`` recomputes
all of it and compares. Re-record only when the published actor changes.
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Dict, List, Optional

import torch

from timm_dora.data import eval_transform, open_split
from timm_dora.evaluate import environment, write_json
from timm_dora import policy_of, run, unwrap, wrap
from timm_dora.backbone import create_backbone
from benchmarks.common import command_line

SHARED = Path(__file__).resolve().parents[2] / "shared"


def reference_decisions(model_name: str, weights: Path, actor, labels_csv: Path, n: int) -> Dict:
    """Native and DORA predictions, gates, removed tokens and GFLOPs on the first ``n`` test images."""
    torch.set_num_threads(1)
    model = create_backbone(model_name, str(weights))
    ds = open_split(str(labels_csv), "test", eval_transform(model))
    x = torch.stack([ds[i][0] for i in range(n)])
    y = [ds[i][1] for i in range(n)]
    with torch.no_grad():
        native = model(x).argmax(1)
        wrap(model, actor)
        logits, stats = run(model, x, policy_of(model))
        unwrap(model)
    pred = logits.argmax(1)
    return {
        "images": [Path(p).name for p in ds.paths[:n]],
        "labels": y,
        "native_pred": native.tolist(),
        "dora_pred": pred.tolist(),
        "gate": stats.gate.long().tolist(),
        "removed": stats.removed.tolist(),
        "gflops": stats.gflops.tolist(),
        "native_correct": int(sum(int(a == b) for a, b in zip(native.tolist(), y))),
        "dora_correct": int(sum(int(a == b) for a, b in zip(pred.tolist(), y))),
    }


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--actor", required=True, help="actor folder (timm_dora/hub/actors/<name>)")
    ap.add_argument("--weights", default=None, help="backbone safetensors (default: ../shared/weights/<model>*)")
    ap.add_argument("--data", default=str(SHARED / "data" / "imagenet-mini" / "labels.csv"))
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    weights = Path(args.weights) if args.weights else next((SHARED / "weights").glob(f"{args.model}*.safetensors"))
    ref = reference_decisions(args.model, weights, args.actor, Path(args.data), args.images)
    digest = hashlib.sha256((Path(args.actor) / "model.safetensors").read_bytes()).hexdigest()
    payload = {
        **environment(torch.device("cpu"), command_line("record_actor_reference", argv)),
        "model": args.model, "weights": weights.name, "actor": args.actor, "actor_sha256": digest,
        "split": "test", "dtype": "float32", **ref,
    }
    write_json(args.out, payload)
    print(f"{args.out}: native {ref['native_correct']}/{args.images}, DORA {ref['dora_correct']}/{args.images}, "
          f"mean GFLOPs {sum(ref['gflops']) / args.images:.3f}")


if __name__ == "__main__":
    main()
