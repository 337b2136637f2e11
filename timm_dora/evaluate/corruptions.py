"""Corrupted copies of preprocessed images, with ImageNet-C's parameters (ours).

Four of ImageNet-C's families (Hendrycks & Dietterich, ICLR 2019), on images already resized and
centre-cropped, as ImageNet-C corrupts its 224 px crops: ``[B, 3, H, W]`` floats in ``[0, 1]``
(before the model's normalisation). Implemented with torch, torchvision's Gaussian blur and PIL's JPEG codec, not the
``imagecorruptions`` package (which needs scikit-image and OpenCV), with that package's severity
parameters:

=================  ======================================  =====================================
family             operation                               parameter at severity 1 .. 5
=================  ======================================  =====================================
``gaussian_noise``  ``x + N(0, c^2)``, clipped to [0, 1]    ``c`` = 0.08, 0.12, 0.18, 0.26, 0.38
``gaussian_blur``   Gaussian filter, reflected borders      ``sigma`` = 1, 2, 3, 4, 6 px
``jpeg``            PIL's JPEG round trip, 8-bit image      quality 25, 18, 15, 10, 7
``contrast``        ``(x - m) c + m``, ``m`` the image mean ``c`` = 0.4, 0.3, 0.2, 0.1, 0.05
=================  ======================================  =====================================

The blur kernel spans ``2 ceil(3 sigma) + 1`` pixels (skimage's truncation at 4 sigma differs only
in the far tails). Noise is drawn from a seeded generator, per call, so a corrupted set is the same
on every run.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence

import torch

__all__ = ["FAMILIES", "corrupt"]

FAMILIES: Dict[str, Sequence[float]] = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "gaussian_blur": (1.0, 2.0, 3.0, 4.0, 6.0),
    "jpeg": (25, 18, 15, 10, 7),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
}


def corrupt(x: torch.Tensor, family: str, severity: int, seed: int = 0) -> torch.Tensor:
    """``x`` (``[B, 3, H, W]`` in ``[0, 1]``) corrupted by ``family`` at ``severity`` (1-5)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown corruption {family!r}; choose from {sorted(FAMILIES)}")
    if not 1 <= severity <= 5:
        raise ValueError(f"severity is 1 to 5, got {severity}")
    if x.dim() != 4 or x.shape[1] != 3:
        raise ValueError(f"expected images [B, 3, H, W], got {tuple(x.shape)}")
    c = FAMILIES[family][severity - 1]
    x = x.float()
    if family == "gaussian_noise":
        gen = torch.Generator(device=x.device).manual_seed(seed)
        return (x + c * torch.randn(x.shape, generator=gen, device=x.device)).clamp(0, 1)
    if family == "contrast":
        m = x.mean(dim=(1, 2, 3), keepdim=True)
        return ((x - m) * c + m).clamp(0, 1)
    if family == "gaussian_blur":
        from torchvision.transforms.functional import gaussian_blur

        size = 2 * math.ceil(3 * c) + 1
        return gaussian_blur(x, [size, size], [c, c]).clamp(0, 1)
    return _jpeg(x, int(c))


def _jpeg(x: torch.Tensor, quality: int) -> torch.Tensor:
    """The JPEG round trip of each 8-bit image with PIL, as ImageNet-C makes it."""
    import io

    import numpy as np
    from PIL import Image

    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for img in u8:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        out.append(torch.from_numpy(np.asarray(Image.open(buf).convert("RGB")).copy()))
    return torch.stack(out).permute(0, 3, 1, 2).to(x.device).float() / 255
