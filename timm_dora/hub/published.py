"""The published actors, and what an ``actor`` argument resolves to.

``registry.json`` maps a backbone's timm name (``"architecture.tag"``) to its actor: ``folder``, the
copy shipped inside this package (``timm_dora/hub/actors/<folder>``: a few hundred kB each), and
``repo_id``, the Hugging Face Hub repository it is published to. Offline first: a registered
backbone's actor is read from the package, with no network; the Hub serves everything else
(``"hf-hub:org/name"``, bare repo ids). When the Hub cannot be reached (no connection, or
``HF_HUB_OFFLINE=1``) a Hub actor comes from huggingface_hub's cache, and if it is not cached the
call fails at once with a message saying what to pass instead, not after huggingface_hub's
retries (about 25 s).
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union
from urllib.parse import urlparse

import torch.nn as nn

from ..policy import Actor
from .files import HF_PREFIX, _is_local, backbone_info, check_backbone, load_pretrained

__all__ = ["ACTORS_DIR", "REGISTRY_FILE", "available_actors", "hub_reachable", "load_actor", "packaged_actor",
           "registry", "resolve_actor"]

PathLike = Union[str, "os.PathLike[str]"]

HERE = Path(__file__).resolve().parent
REGISTRY_FILE = HERE / "registry.json"  # package data, next to the actors it names
ACTORS_DIR = HERE / "actors"  # package data: one folder per published actor (config, weights, model card)
PROBE_TIMEOUT_S = 2.0  # how long resolving an actor waits to learn whether the Hub answers at all


def registry(path: Optional[PathLike] = None) -> Dict[str, Dict[str, str]]:
    """The registry of published actors: ``{"architecture.tag": {"repo_id": ..., "folder": ...}}``."""
    path = Path(path) if path is not None else REGISTRY_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def available_actors() -> List[str]:
    """Sorted names (``"architecture.tag"``) of the backbones with a registered pretrained actor."""
    return sorted(registry())


def packaged_actor(name: str) -> Optional[Path]:
    """The folder of the actor shipped in this package for backbone ``name`` (``None`` if none)."""
    entry = registry().get(name)
    if entry is None or not entry.get("folder"):
        return None
    folder = ACTORS_DIR / entry["folder"]
    return folder if (folder / "model.safetensors").is_file() else None


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> Tuple[bool, str]:
    """``(whether a connection to the Hub's endpoint opens within timeout, why not)``; ``False``
    at once with ``HF_HUB_OFFLINE=1``. Behind a proxy (``HTTPS_PROXY`` and the like) a direct
    connection says nothing, so the Hub is taken as reachable and huggingface_hub decides."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True, ""
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return False, f"{host} is unreachable ({e})"
    return True, ""


def _model_name(model: nn.Module) -> str:
    info = backbone_info(model)
    if not info["architecture"]:
        raise ValueError("the model has no pretrained_cfg architecture: pass actor= explicitly")
    return f"{info['architecture']}.{info['pretrained_tag']}" if info["pretrained_tag"] else info["architecture"]


def _from_hub(source: str, hub_kwargs: Dict) -> Tuple[Actor, Dict]:
    """:func:`load_pretrained` from the Hub, or from huggingface_hub's cache alone where the Hub
    does not answer (then a ``FileNotFoundError`` at once if it is not cached)."""
    if hub_kwargs.get("local_files_only"):
        return load_pretrained(source, **hub_kwargs)
    reachable, why = hub_reachable()
    if reachable:
        return load_pretrained(source, **hub_kwargs)
    try:
        return load_pretrained(source, **{**hub_kwargs, "local_files_only": True})
    except OSError:
        raise FileNotFoundError(
            f"actor {source!r} is on the Hugging Face Hub, which cannot be reached ({why}), and it is not in the "
            "local cache: pass a local actor folder (or a timm_dora.Actor) instead"
        ) from None


def _is_hub_id(source: str) -> bool:
    return source.startswith(HF_PREFIX) or not _is_local(source)


def _shipped(source: str, hub_kwargs: Dict) -> Optional[Path]:
    """The packaged folder ``source`` names: a registered backbone (``"architecture.tag"``) or the Hub
    repository of a registered actor (with or without ``hf-hub:``). ``None`` for anything else, and
    when a ``revision`` or ``force_download`` asks for the Hub's copy."""
    if hub_kwargs.get("revision") or hub_kwargs.get("force_download") or _is_local(source) and not source.startswith(HF_PREFIX):
        return None
    name = source[len(HF_PREFIX):] if source.startswith(HF_PREFIX) else source
    for backbone, entry in registry().items():
        if name in (backbone, entry.get("repo_id")):
            return packaged_actor(backbone)
    return None


def load_actor(source: PathLike, **hub_kwargs) -> Tuple[Actor, Dict]:
    """``(actor, config)`` for an actor named by text; the one path every ``actor``, ``--actor``,
    ``--teacher`` and ``--init-actor`` argument takes (and ``Actor.from_pretrained``).

    In order: an actor shipped in this package (named by its backbone, ``"architecture.tag"``, or by
    its Hub repository, ``"org/name"`` or ``"hf-hub:org/name"``; no network) unless ``revision`` or
    ``force_download`` asks for the Hub's copy; a local folder; the Hub, through huggingface_hub's
    cache at once when a short probe finds the Hub unreachable, with a message naming what to pass
    instead when the actor is not cached. ``hub_kwargs`` as for
    :func:`~timm_dora.hub.files.load_pretrained`.
    """
    source = os.fspath(source)
    folder = _shipped(source, hub_kwargs)
    if folder is not None:
        return load_pretrained(folder)
    if _is_hub_id(source):
        return _from_hub(source, hub_kwargs)
    return load_pretrained(source, **hub_kwargs)


def resolve_actor(model: nn.Module, actor: Union[Actor, PathLike, None] = None, *, readout: Optional[str] = None,
                  **hub_kwargs) -> Actor:
    """The actor to use with ``model``.

    - an :class:`Actor`: returned as is, after the same backbone check as its folder's when it
      was loaded with ``Actor.from_pretrained`` (its ``pretrained_config``);
    - a string or path: a shipped actor, a local folder, ``"hf-hub:org/name"`` or a bare Hub repo
      id, loaded with :func:`load_actor` (``hub_kwargs``) and checked with
      :func:`~timm_dora.hub.files.check_backbone`;
    - ``None``: the registered actor for the model's ``pretrained_cfg`` (``architecture.tag``),
      read from this package (no network; from its Hub repository if the package does not ship
      it); ``ValueError`` listing :func:`available_actors` if none is registered.
    """
    if isinstance(actor, Actor):
        config = getattr(actor, "pretrained_config", None)  # (an Actor.from_pretrained: checked as its folder is)
        if config is not None:
            check_backbone(config, model, readout)
        return actor
    if actor is None:
        name = _model_name(model)
        entry = registry().get(name)
        if entry is None:
            raise ValueError(
                f"no pretrained DORA actor is registered for {name!r}; available: "
                f"{', '.join(available_actors()) or 'none'}. Pass actor= (an Actor, a folder or 'hf-hub:org/name')"
            )
        folder = packaged_actor(name)
        if folder is not None:
            loaded, config = load_pretrained(folder)
        else:  # registered, not shipped: its Hub repository
            loaded, config = _from_hub(entry["repo_id"], hub_kwargs)
    elif isinstance(actor, (str, os.PathLike)):
        loaded, config = load_actor(actor, **hub_kwargs)
    else:
        raise TypeError(f"actor must be a timm_dora.Actor, a path, a Hub repo id or None; got {type(actor).__name__}")
    check_backbone(config, model, readout)
    return loaded
