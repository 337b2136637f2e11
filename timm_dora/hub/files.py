"""Pretrained actors: ``config.json`` + ``model.safetensors``, in a folder or on the Hugging Face Hub.

An actor folder (and a Hub repository) holds::

    config.json        format, format_version, library_version, actor (constructor kwargs),
                       backbone (what it was trained on), budget_grid, training (free notes)
    model.safetensors  actor.state_dict()
    README.md          model card (published repositories)

Only ``model.safetensors`` is ever read: pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ...)
are refused, and ``config.json`` is validated field by field before any tensor is read. Remote
files are fetched with :func:`huggingface_hub.hf_hub_download`, so its cache, revisions, tokens and
``HF_HUB_OFFLINE`` apply unchanged.

The published actors and how an actor argument is resolved are :mod:`timm_dora.hub.published`.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..engine.patch import READOUTS
from ..policy import Actor
from ..version import __version__

__all__ = ["FORMAT", "FORMAT_VERSION", "CONFIG_NAME", "WEIGHTS_NAME", "backbone_info", "save_pretrained",
           "load_pretrained", "validate_config", "check_backbone", "push_to_hub"]

FORMAT = "timm-dora-actor"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
HF_PREFIX = "hf-hub:"

PathLike = Union[str, "os.PathLike[str]"]

_ACTOR_SIG = inspect.signature(Actor.__init__).parameters
_ACTOR_REQUIRED = ("embed_dim", "depth", "num_patches")
_ACTOR_DEFAULTS = {n: p.default for n, p in _ACTOR_SIG.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
_BACKBONE_INTS = ("embed_dim", "depth", "num_patches", "num_prefix_tokens")


# --------------------------------------------------------------------------------------------
# config


def backbone_info(model: nn.Module, readout: str = "model") -> Dict[str, Any]:
    """The ``backbone`` entry of ``config.json`` for a timm ViT (name, tag and the sizes the actor reads)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    return {
        "architecture": cfg.get("architecture"),
        "pretrained_tag": cfg.get("tag") or None,
        "embed_dim": int(model.embed_dim),
        "depth": len(model.blocks),
        "num_patches": int(model.patch_embed.num_patches),
        "num_prefix_tokens": int(model.num_prefix_tokens),
        "readout": readout,
    }


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"invalid actor config field '{field}': {message}")


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(field, f"must be an int >= 1, got {value!r}")
    return value


def _optional_str(field: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise _fail(field, f"must be a non-empty string or null, got {value!r}")


def validate_config(config: Any) -> Dict[str, Any]:
    """Check every field of a parsed ``config.json``; return the actor's constructor kwargs.

    Raises ``ValueError`` naming the offending field. Reads no tensors and allocates nothing
    proportional to the sizes in the config.
    """
    if not isinstance(config, dict):
        raise ValueError(f"invalid actor config: expected a JSON object, got {type(config).__name__}")
    if config.get("format") != FORMAT:
        raise _fail("format", f"must be {FORMAT!r}, got {config.get('format')!r} (not a timm-dora actor)")
    version = _positive_int("format_version", config.get("format_version"))
    if version != FORMAT_VERSION:
        raise _fail("format_version", f"{version} is not supported; this timm-dora reads version {FORMAT_VERSION}")
    if not isinstance(config.get("library_version"), str):
        raise _fail("library_version", f"must be a string, got {config.get('library_version')!r}")

    actor = config.get("actor")
    if not isinstance(actor, dict):
        raise _fail("actor", f"must be an object of Actor constructor arguments, got {actor!r}")
    unknown = sorted(set(actor) - set(_ACTOR_REQUIRED) - set(_ACTOR_DEFAULTS))
    if unknown:
        raise _fail(f"actor.{unknown[0]}", "is not an Actor constructor argument")
    for name in _ACTOR_REQUIRED:
        if name not in actor:
            raise _fail(f"actor.{name}", "is missing")
    kwargs = {**_ACTOR_DEFAULTS, **actor}
    for name, value in kwargs.items():
        if name == "summary":
            if value not in Actor.SUMMARIES:
                raise _fail("actor.summary", f"must be one of {Actor.SUMMARIES}, got {value!r}")
            continue
        if name == "merge":
            if not isinstance(value, bool):
                raise _fail("actor.merge", f"must be true or false, got {value!r}")
            continue
        _positive_int(f"actor.{name}", value)
    if kwargs["width"] % kwargs["num_heads"]:
        raise _fail("actor.num_heads", f"{kwargs['num_heads']} does not divide actor.width={kwargs['width']}")
    step, n0, min_keep = kwargs["budget_step"], kwargs["num_patches"], kwargs["min_keep"]
    m = (n0 - min_keep) // step
    if m < 1:
        raise _fail("actor.num_patches", f"{n0} leaves no budget with actor.min_keep={min_keep}, actor.budget_step={step}")

    grid = config.get("budget_grid")
    if not isinstance(grid, list) or any(isinstance(k, bool) or not isinstance(k, int) for k in grid):
        raise _fail("budget_grid", "must be a list of ints")
    if len(grid) != m or any(k != step * (i + 1) for i, k in enumerate(grid)):
        raise _fail(
            "budget_grid",
            f"does not match the grid implied by actor.num_patches={n0}, actor.budget_step={step}, "
            f"actor.min_keep={min_keep}: expected [{step}, {2 * step}, ..., {m * step}] (M={m})",
        )

    backbone = config.get("backbone")
    if backbone is not None:
        if not isinstance(backbone, dict):
            raise _fail("backbone", f"must be an object or null, got {backbone!r}")
        for name in ("architecture", "pretrained_tag"):
            _optional_str(f"backbone.{name}", backbone.get(name))
        for name in _BACKBONE_INTS:
            value = backbone.get(name)
            if name == "num_prefix_tokens" and value == 0 and not isinstance(value, bool):  # (no class token, no registers)
                continue
            _positive_int(f"backbone.{name}", value)
        if backbone.get("readout") not in READOUTS:
            raise _fail("backbone.readout", f"must be one of {READOUTS}, got {backbone.get('readout')!r}")
        for name in ("embed_dim", "depth", "num_patches"):
            if backbone[name] != kwargs[name]:
                raise _fail(f"backbone.{name}", f"{backbone[name]} disagrees with actor.{name}={kwargs[name]}")

    if not isinstance(config.get("training", {}), dict):
        raise _fail("training", f"must be an object, got {config.get('training')!r}")
    return kwargs


def _make_config(actor: Actor, backbone: Optional[Dict[str, Any]], training: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "actor": actor.config(),
        "backbone": backbone,
        "budget_grid": actor.budgets.tolist(),
        "training": dict(training or {}),
    }
    validate_config(config)
    return config


# --------------------------------------------------------------------------------------------
# weights


def _meta_shapes(kwargs: Dict[str, int]) -> Dict[str, Tuple[int, ...]]:
    """Tensor shapes of ``Actor(**kwargs)``, built on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Actor(**kwargs).state_dict().items()}


@functools.lru_cache(maxsize=1)
def _shape_fields() -> Dict[str, Tuple[str, ...]]:
    """For each tensor, the actor config fields its shape depends on (found by doubling each field)."""
    base = {"embed_dim": 8, "depth": 2, "num_patches": 16, **_ACTOR_DEFAULTS}  # config order
    ref = _meta_shapes(base)
    deps: Dict[str, List[str]] = {k: [] for k in ref}
    for field in base:
        if not isinstance(base[field], int) or isinstance(base[field], bool):  # (summary, merge: choices,
            # no shape depends on them)
            continue
        changed = _meta_shapes({**base, field: 2 * base[field]})
        for k in ref:
            if changed[k] != ref[k]:
                deps[k].append(field)
    return {k: tuple(v) for k, v in deps.items()}


def _read_weights(path: Path, kwargs: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """Read ``model.safetensors`` after checking its names, dtypes and shapes against the config."""
    from safetensors import safe_open

    expected = _meta_shapes(kwargs)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        names = set(f.keys())
        missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
        if missing or unexpected:
            raise ValueError(f"{path.name} does not match the actor config: missing tensors {missing}, unexpected tensors {unexpected}")
        for name in sorted(names):
            part = f.get_slice(name)
            shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if dtype not in ("F16", "BF16", "F32", "F64"):
                raise ValueError(f"{name} has dtype {dtype}; actor weights must be floating point")
            if shape != expected[name]:
                fields = ", ".join(f"actor.{k}={kwargs[k]}" for k in _shape_fields().get(name, ())) or "the actor config"
                raise ValueError(f"{name} has shape {list(shape)} but config {fields} gives {list(expected[name])}")
        return {name: f.get_tensor(name) for name in names}


# --------------------------------------------------------------------------------------------
# save / load


def save_pretrained(
    actor: Actor,
    save_directory: PathLike,
    *,
    backbone: Union[nn.Module, Dict[str, Any], None] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``actor`` into ``save_directory``.

    Args:
        backbone: the timm model the actor was trained for (its :func:`backbone_info` is stored,
            with ``readout="model"``), or a ready ``backbone`` dict (e.g. ``backbone_info(model,
            "lc1")``). ``None`` stores ``null``: the actor is then checked against a model by size only.
        extra: free-form JSON-serialisable notes stored as ``config["training"]`` (target drop,
            selected metrics, ...).

    Returns the directory.
    """
    from safetensors.torch import save_file

    if isinstance(backbone, nn.Module):
        backbone = backbone_info(backbone)
    config = _make_config(actor, backbone, extra)
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in actor.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _refused(where: str) -> ValueError:
    return ValueError(
        f"{where} has no {WEIGHTS_NAME}: pickle checkpoints (pytorch_model.bin, *.pt, *.pth, *.bin) are refused; "
        f"timm-dora only loads safetensors"
    )


def _has_pickles(folder: Path) -> bool:
    return folder.is_dir() and any(p.suffix in PICKLE_SUFFIXES for p in folder.iterdir())


def _parse_config(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _local_files(folder: Path) -> Tuple[Path, Path]:
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    if not weights.is_file():
        if _has_pickles(folder):
            raise _refused(str(folder))
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME}")
    if not config.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}")
    return config, weights


def _is_local(source: str) -> bool:
    """A folder, or a string that cannot be a Hub repo id (``name`` or ``org/name``)."""
    return (
        os.path.isdir(os.path.expanduser(source))
        or source.startswith((".", "/", "~"))
        or "\\" in source
        or source.count("/") > 1
    )


def load_pretrained(
    repo_id_or_path: PathLike,
    *,
    revision: Optional[str] = None,
    cache_dir: Optional[PathLike] = None,
    local_files_only: bool = False,
    token: Union[str, bool, None] = None,
    force_download: bool = False,
) -> Tuple[Actor, Dict[str, Any]]:
    """Load an actor saved by :func:`save_pretrained`: returns ``(actor, config)``.

    ``repo_id_or_path`` is a local folder, a Hub repo id (``"org/name"``) or ``"hf-hub:org/name"``
    (an existing folder wins over a repo id spelled the same; the prefix always means the Hub).
    Hub files go through :func:`huggingface_hub.hf_hub_download` (cache, ``revision``, ``token``,
    ``local_files_only``, ``force_download`` and ``HF_HUB_OFFLINE`` behave as there). The config is
    validated before any tensor is read; tensor names and shapes are checked against it. The actor
    is returned in eval mode on the CPU, with the config also at ``actor.pretrained_config``.
    """
    source = os.fspath(repo_id_or_path)
    if source.startswith(HF_PREFIX):
        config_path, weights = _hub_files(source[len(HF_PREFIX):], revision, cache_dir, local_files_only, token, force_download)
    elif _is_local(source):
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"no actor folder at {source}")
        config_path, weights = _local_files(folder)
    else:
        config_path, weights = _hub_files(source, revision, cache_dir, local_files_only, token, force_download)
    try:
        config = _parse_config(config_path)
        kwargs = validate_config(config)
        state = _read_weights(weights, kwargs)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    actor = Actor(**kwargs)
    actor.load_state_dict(state)
    actor.eval()
    actor.pretrained_config = config
    return actor, config


def _hub_files(repo_id, revision, cache_dir, local_files_only, token, force_download) -> Tuple[Path, Path]:
    """``config.json`` then ``model.safetensors`` through huggingface_hub; returns local paths."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path:
        return Path(
            hf_hub_download(
                repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                token=token, force_download=force_download, library_name="timm-dora", library_version=__version__,
            )
        )

    try:
        config = fetch(CONFIG_NAME)
    except LocalEntryNotFoundError:
        raise  # not cached and the Hub is unreachable: huggingface_hub's own message says so
    except EntryNotFoundError as e:
        raise ValueError(f"Hub repo {repo_id} has no {CONFIG_NAME}: not a timm-dora actor repository") from e
    try:
        weights = fetch(WEIGHTS_NAME)
    except LocalEntryNotFoundError:
        if _has_pickles(config.parent):  # the cached snapshot holds a pickle checkpoint instead
            raise _refused(f"Hub repo {repo_id}") from None
        raise
    except EntryNotFoundError as e:
        raise _refused(f"Hub repo {repo_id}") from e
    return config, weights


def check_backbone(config: Dict[str, Any], model: nn.Module, readout: Optional[str] = None) -> None:
    """Raise ``ValueError`` naming the field where ``config['backbone']`` does not describe ``model``.

    Sizes (``embed_dim``, ``depth``, ``num_prefix_tokens``), ``architecture`` (when both sides know
    it) and ``readout`` (when given) must match, and an actor that reads the CLS key needs a model
    with a class token; a different ``pretrained_tag`` only warns (e.g. another fine-tune of the same
    architecture). The patch count may differ: an actor runs at any input size (its budget grid is
    read as fractions of the patches it was trained with, :meth:`~timm_dora.policy.Actor.grid`). A
    ``null`` backbone is checked through the actor's sizes only.
    """
    have = backbone_info(model, readout or "model")
    kwargs = validate_config(config)
    want = config.get("backbone") or {k: kwargs[k] for k in ("embed_dim", "depth")}
    prefix = "backbone" if config.get("backbone") else "actor"
    if kwargs.get("summary", "cls") == "cls" and getattr(model, "cls_token", None) is None:
        raise ValueError("actor does not fit this model: it reads the CLS key (config actor.summary='cls') and the "
                         "model has no class token")
    for name in ("embed_dim", "depth", "num_prefix_tokens"):
        if name in want and want[name] != have[name]:
            raise ValueError(f"actor does not fit this model: config {prefix}.{name}={want[name]} but the model has {name}={have[name]}")
    if want.get("architecture") and have["architecture"] and want["architecture"] != have["architecture"]:
        raise ValueError(
            f"actor does not fit this model: config backbone.architecture={want['architecture']!r} but the model is {have['architecture']!r}"
        )
    if readout is not None and want.get("readout", readout) != readout:
        raise ValueError(f"actor was trained with config backbone.readout={want['readout']!r}, not readout={readout!r}")
    tag = want.get("pretrained_tag")
    if tag and have["pretrained_tag"] and tag != have["pretrained_tag"]:
        warnings.warn(f"actor was trained on {want['architecture']}.{tag}; the model's weights are tagged {have['pretrained_tag']!r}")


# --------------------------------------------------------------------------------------------
# Hub upload


def push_to_hub(
    actor: Actor,
    repo_id: str,
    *,
    token: Optional[str] = None,
    private: Optional[bool] = None,
    commit_message: str = "Upload timm-dora actor",
    backbone: Union[nn.Module, Dict[str, Any], None] = None,
    extra: Optional[Dict[str, Any]] = None,
):
    """Create ``repo_id`` if needed and upload ``config.json`` + ``model.safetensors`` in one commit.

    Returns huggingface_hub's ``CommitInfo``. Add a model card separately (see the repository's ``hub/README.md``).
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(actor, tmp, backbone=backbone, extra=extra)
        return api.upload_folder(repo_id=repo.repo_id, folder_path=tmp, commit_message=commit_message)
