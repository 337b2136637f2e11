"""A frozen timm backbone, its weights read from a local safetensors file (the training,
evaluation and picture commands' ``--model`` / ``--weights``)."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

__all__ = ["create_backbone"]


def create_backbone(name: str, weights: Optional[str] = None, pretrained: bool = False, **kwargs) -> nn.Module:
    """A frozen timm model in eval mode; ``weights``: a local safetensors file of its state dict.

    The file is loaded with ``load_state_dict`` (strict) rather than through
    ``pretrained_cfg_overlay``, which some timm versions route to their JAX ``.npz`` loader for
    AugReg models. The model keeps its ``pretrained_cfg`` (architecture and tag).
    """
    import timm

    if weights is not None:
        if not str(weights).endswith(".safetensors"):
            raise ValueError(f"--weights must be a .safetensors file (pickle checkpoints are not loaded): {weights}")
        from safetensors.torch import load_file

        model = timm.create_model(name, pretrained=False, **kwargs)
        model.load_state_dict(load_file(str(weights)))
    else:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    return model.eval().requires_grad_(False)
