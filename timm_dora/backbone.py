"""A frozen timm backbone, its weights read from a local safetensors file (the training,
evaluation and picture commands' ``--model`` / ``--weights``)."""
from __future__ import annotations

import re
from typing import Dict, Optional

import torch
import torch.nn as nn

__all__ = ["create_backbone"]


def create_backbone(name: str, weights: Optional[str] = None, pretrained: bool = False, **kwargs) -> nn.Module:
    """A frozen timm model in eval mode; ``weights``: a local safetensors file of its state dict.

    A file made for another model is refused in one line, ``weights FILE (for ...) do not fit model
    NAME (...)``, naming the sizes that differ. The file is loaded with ``load_state_dict`` (strict)
    rather than through
    ``pretrained_cfg_overlay``, which some timm versions route to their JAX ``.npz`` loader for
    AugReg models. The model keeps its ``pretrained_cfg`` (architecture and tag).
    """
    import timm

    if weights is not None:
        if not str(weights).endswith(".safetensors"):
            raise ValueError(f"--weights must be a .safetensors file (pickle checkpoints are not loaded): {weights}")
        from safetensors.torch import load_file

        model = timm.create_model(name, pretrained=False, **kwargs)
        state = load_file(str(weights))
        _check_fits(state, model, str(weights), name)
        model.load_state_dict(state)
    else:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    return model.eval().requires_grad_(False)


def _sizes(state: Dict[str, torch.Tensor]) -> str:
    """What a state dict's tensors say of its model: width, blocks, classes (those it has)."""
    blocks = {int(m.group(1)) for k in state for m in [re.match(r"blocks\.(\d+)\.", k)] if m}
    parts = []
    if "patch_embed.proj.weight" in state:
        parts.append(f"width {state['patch_embed.proj.weight'].shape[0]}")
    if blocks:
        parts.append(f"{max(blocks) + 1} blocks")
    if "head.weight" in state:
        parts.append(f"{state['head.weight'].shape[0]} classes")
    return ", ".join(parts) or f"{len(state)} tensors"


def _check_fits(state: Dict[str, torch.Tensor], model: nn.Module, path: str, name: str) -> None:
    """``ValueError`` in one line when ``state`` is not a state dict of ``model`` (names or shapes)."""
    want = model.state_dict()
    shapes = [k for k in state if k in want and state[k].shape != want[k].shape]
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state if k not in want]
    if not (shapes or missing or unexpected):
        return
    if shapes:
        first = f"{shapes[0]} is {list(state[shapes[0]].shape)} in the file, {list(want[shapes[0]].shape)} in the model"
    else:
        first = f"{missing[0]} is missing from the file" if missing else f"{unexpected[0]} is not in the model"
    raise ValueError(
        f"weights {path} ({_sizes(state)}) do not fit model {name} ({_sizes(want)}): {len(shapes)} shapes differ, "
        f"{len(missing)} missing, {len(unexpected)} unexpected (first: {first})")
