"""Wrap a timm ViT with a DORA actor, classify real images, and read the per-forward statistics.

    python examples/prune_vit_tiny.py            # uses ../shared weights and images when present

``timm_dora.wrap(model)`` with no actor takes the actor published for this backbone, shipped
inside the package (no network; the same files as the Hub repo
``timm-dora/vit_tiny_patch16_224.augreg_in21k_ft_in1k``: it saves 33.5 % of the GFLOPs for 0.77 pp
of top-1 on the 1,300 test images; how it was trained is in its model card). Any other actor loads the same way:
``timm_dora.wrap(model, "path/or/hf-hub:org/name")``.
"""
import csv
import sys
from pathlib import Path

import timm
import torch

import timm_dora

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
WEIGHTS = SHARED / "weights" / "vit_tiny_patch16_224.augreg_in21k_ft_in1k.safetensors"
DATA = SHARED / "data" / "imagenet-mini"


def main(n_images: int = 16) -> None:
    pretrained = WEIGHTS.exists()
    model = timm.create_model("vit_tiny_patch16_224.augreg_in21k_ft_in1k").eval()
    if pretrained:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(WEIGHTS)))
    if pretrained and (DATA / "labels.csv").exists():
        from PIL import Image

        tf = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
        rows = [r for r in csv.DictReader(open(DATA / "labels.csv")) if r["split"] == "dev"][:n_images]
        x = torch.stack([tf(Image.open(DATA / r["path"]).convert("RGB")) for r in rows])
        labels = torch.tensor([int(r["label"]) for r in rows])
    else:
        print("../shared not found: random weights and random images", file=sys.stderr)
        x, labels = torch.randn(n_images, 3, 224, 224), None

    with torch.no_grad():
        native = model(x)
        timm_dora.wrap(model)  # the actor published for this backbone
        pruned = model(x)
    s = model.dora_stats
    print(f"attention backend: {s.backend}")
    print(f"native GFLOPs/image: {timm_dora.native_gflops(model):.3f}")
    print(f"DORA GFLOPs/image: mean {s.gflops.mean():.3f}, range {s.gflops.min():.3f}-{s.gflops.max():.3f} "
          f"(actor {s.policy_gflops.mean():.4f})")
    print("gate rate per block:", [round(v, 2) for v in s.gate.float().mean(0).tolist()])
    print("visual tokens after each block, image 0:", s.tokens[0].tolist())
    if labels is not None:
        print(f"top-1 native {(native.argmax(1) == labels).float().mean():.3f}, "
              f"wrapped {(pruned.argmax(1) == labels).float().mean():.3f} on {len(labels)} dev images")
    timm_dora.unwrap(model)


if __name__ == "__main__":
    main()
