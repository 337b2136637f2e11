"""Pretrained actors: files (``config.json`` + ``model.safetensors``, :mod:`~timm_dora.hub.files`),
the published actors shipped in this package and the resolution of an ``actor`` argument
(:mod:`~timm_dora.hub.published`).

Importing this package adds ``Actor.from_pretrained``, ``Actor.save_pretrained`` and
``Actor.push_to_hub``.
"""
from ..policy import Actor
from .files import (CONFIG_NAME, FORMAT, FORMAT_VERSION, WEIGHTS_NAME, PathLike, backbone_info, check_backbone,
                    load_pretrained, push_to_hub, save_pretrained, validate_config)
from .published import (ACTORS_DIR, REGISTRY_FILE, available_actors, hub_reachable, load_actor, packaged_actor, registry,
                        resolve_actor)

__all__ = ["ACTORS_DIR", "CONFIG_NAME", "FORMAT", "FORMAT_VERSION", "REGISTRY_FILE", "WEIGHTS_NAME", "available_actors",
           "backbone_info", "check_backbone", "hub_reachable", "load_actor", "load_pretrained", "packaged_actor", "push_to_hub",
           "registry", "resolve_actor", "save_pretrained", "validate_config"]


def _from_pretrained(cls, repo_id_or_path: PathLike, **hub_kwargs) -> Actor:
    """Load a pretrained actor: shipped in this package, a local folder or from the Hub (see
    :func:`timm_dora.hub.load_actor`); its config is ``actor.pretrained_config``."""
    return load_actor(repo_id_or_path, **hub_kwargs)[0]


Actor.from_pretrained = classmethod(_from_pretrained)
Actor.save_pretrained = save_pretrained
Actor.push_to_hub = push_to_hub
