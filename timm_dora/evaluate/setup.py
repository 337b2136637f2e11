"""What every ``timm-dora eval`` / ``bench`` run sets up and records: the backbone
(:func:`load_model`), its precision (:func:`precision_for`), the environment written into result
files (:func:`environment`) and the files themselves (:func:`write_json`)."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..backbone import create_backbone
from ..version import __version__

__all__ = ["PRECISIONS", "environment", "load_model", "precision_for", "write_json"]

PRECISIONS = ("auto", "fp32", "bf16", "bf16-autocast")


def environment(device: torch.device, command: Optional[str] = None) -> Dict[str, Any]:
    """Device, versions and the command line (default: ``sys.argv``), for result JSON files."""
    import timm

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    if command is None:
        command = " ".join([Path(sys.argv[0]).name] + sys.argv[1:])
    return {
        "command": command,
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "timm": timm.__version__,
        "timm_dora": __version__,
        "python": platform.python_version(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
    }


def precision_for(device: torch.device, precision: str = "auto") -> Tuple[torch.dtype, bool]:
    """``(weights/activations dtype, autocast)`` for ``precision`` on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    cuda = torch.device(device).type == "cuda"
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    if precision == "bf16":
        return torch.bfloat16, False
    if precision == "bf16-autocast":
        if not cuda:
            raise ValueError("bf16-autocast is for CUDA; use fp32 (or bf16) on the CPU")
        return torch.float32, True
    return torch.float32, False


def inference_device(device: Optional[str] = None, precision: str = "auto") -> Tuple[torch.device, torch.dtype, bool]:
    """``(device, dtype, autocast)`` for an evaluation: ``device`` (default: CUDA when there is one),
    TF32 off on CUDA (the paper's timing and inference contract) and :func:`precision_for`'s dtype."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype, autocast = precision_for(dev, precision)
    return dev, dtype, autocast


def load_model(
    name: str,
    weights: Optional[str] = None,
    *,
    random_weights: bool = False,
    img_size: Optional[int] = None,
    num_classes: Optional[int] = None,
    seed: int = 0,
    dynamic_img_size: bool = False,
) -> nn.Module:
    """A frozen timm backbone in eval mode: local safetensors ``weights``, random weights
    (``random_weights``, seeded; for smoke tests) or timm's pretrained download.
    ``dynamic_img_size``: timm's option to take any input size (the position embedding resampled
    per input; the weights stay those of the model's own size)."""
    kw: Dict[str, Any] = {}
    if img_size is not None:
        kw["img_size"] = img_size
    if dynamic_img_size:
        kw["dynamic_img_size"] = True
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if weights is not None and random_weights:
        raise ValueError("pass --weights or --random-weights, not both")
    if random_weights:
        torch.manual_seed(seed)
        return create_backbone(name, None, pretrained=False, **kw)
    return create_backbone(name, weights, pretrained=weights is None, **kw)


def write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))
