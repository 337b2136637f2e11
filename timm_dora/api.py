"""The public face: :func:`wrap` a timm ViT with a DORA actor (an :class:`~timm_dora.policy.Actor`, a
folder, a Hub id, or the actor registered for the model) or with any policy.

It resolves the actor (:mod:`timm_dora.hub`), builds its :class:`~timm_dora.policy.ActorPolicy` and
hands the policy to the engine (:func:`timm_dora.engine.patch.wrap`), which knows nothing of
actors' files or the Hub.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.nn as nn

from .engine.capture import policy_of
from .engine.options import EngineOptions
from .engine.patch import check_skip_dead, check_supported, is_wrapped, is_wrapped_as
from .engine.patch import wrap as engine_wrap
from .engine.protocol import Policy
from .hub import resolve_actor
from .policy import Actor, ActorPolicy

__all__ = ["wrap"]


def wrap(
    model: nn.Module,
    actor: Union[Actor, str, "os.PathLike[str]", None] = None,
    *,
    policy: Optional[Policy] = None,
    readout: str = "model",
    attn_backend: str = "auto",
    speculate: bool = False,
    cuda_graphs: Optional[bool] = None,
    skip_dead: bool = False,
    merge: Optional[bool] = None,
    options: Optional[EngineOptions] = None,
    **hub_kwargs,
) -> nn.Module:
    """Patch a timm ``VisionTransformer`` in place so that its forward prunes tokens with DORA.

    Args:
        model: a timm ViT (``VisionTransformer`` or subclass, e.g. DeiT distilled, DINOv2, models
            with register tokens). Its weights are not modified.
        actor: an :class:`~timm_dora.policy.Actor`; a local folder, ``"hf-hub:org/name"`` or Hub
            repo id of a pretrained actor; or ``None`` for the actor registered for the model's
            ``pretrained_cfg`` (shipped inside this package for the registered backbones, see
            :mod:`timm_dora.hub`). It runs with the deterministic deployment rule and is
            registered as ``model.dora_actor``, so ``model.to(...)`` moves it too.
        policy: instead of an actor, any policy callable (see :mod:`timm_dora.engine.protocol`).
        readout: ``"model"`` follows ``model.global_pool`` (CLS token, or ``avg``/``max``/
            ``avgmax`` over surviving patch tokens); ``"lc1"`` is DINOv2's linear readout
            (normed CLS concatenated with the mean of normed surviving patch tokens).
        attn_backend: ``"auto"`` or one of ``triton``, ``flash``, ``torch_varlen``, ``sdpa_loop``
            (:mod:`timm_dora.engine.packing`).
        speculate: inference only, opt-in: each block enqueues its MLP on the unpruned batch
            before the host reads the actor's gate, so the GPU does not idle at that read
            (``ActorPolicy(actor, speculate=True)``). Outputs, decisions and statistics are
            identical; GFLOPs do not count the speculative MLP, which is wasted compute at blocks
            where some gate opens (and keeps the block's keys and input rows alive while it
            runs). Pays when gates rarely open. With ``policy=``, construct the policy with
            ``speculate=True`` instead (it must offer ``begin``, see
            :mod:`timm_dora.engine.protocol`).
        cuda_graphs: ``None`` (the default): wherever it can, the forward is replayed from CUDA
            graphs: on CUDA, in ``eval()`` mode, without autograd (``torch.inference_mode()`` or
            ``no_grad``) and autocast, in bf16/fp16 (cast the model). Each block's attention and
            MLP residuals, the actor's gate and controller with the deletion, and the readout are
            captured on first use and replayed; host decisions run in between
            (:mod:`timm_dora.engine.graphs`). Elsewhere (CPU, training, fp32) it runs eagerly.
            The batch is padded to a bucket (sizes up to 8 as they are, then three significant
            bits: 10, 12, ..., 256, 320, ...; the padding's outputs are dropped) and graphs are kept
            for up to 4 buckets; :func:`timm_dora.engine_info` reports their count, capture time and
            memory, :func:`timm_dora.release_graphs` frees them. A capture that fails falls back to
            eager for good, with one warning (:mod:`timm_dora.engine.capture`). Results match the
            eager forward up to rounding (the captured controller runs on every image, masked, so
            in bf16 a near-tie may decide differently). ``True``: captured, with one warning where
            it cannot be (off CUDA the same segments run uncaptured: how the CPU tests check
            them); ``False``: always eager. The graphs read the weights in place; moving or casting
            the model recaptures.
        skip_dead: the last block's MLP only on the rows a CLS-token readout reads (the prefix
            tokens): the other rows never reach the logits, so the logits are the same (up to
            rounding) for less compute, and the GFLOPs count what runs. Only where the readout is
            the class token (``global_pool="token"``); eager only for now (not with ``cuda_graphs=True``).
        merge: (ours) fold each removed token into its most similar surviving token (size-weighted,
            keys averaged over heads as ToMe matches) and give merged tokens ToMe's proportional
            attention, instead of deleting them (:func:`~timm_dora.engine.packing.merge_removed`;
            the GFLOPs count the matching). ``None`` (the default): as the actor was trained
            (``Actor.merge``), else deletion. Captured like deletion (the fold runs in the
            controller's graph, the sizes in the Triton kernel) for an actor on the ``triton``
            backend; other policies and backends merge eagerly.
        options: how the engine runs the model, an :class:`~timm_dora.engine.options.EngineOptions`
            (speed and memory only: kernels, graph caching, run ahead, the whole-forward graphs);
            ``None``: the active ones at each forward (the defaults, unless a
            ``timm_dora.engine.options.using(...)`` block says otherwise).
            :func:`timm_dora.set_options` changes them later.
        hub_kwargs: ``revision``, ``cache_dir``, ``local_files_only``, ``token``,
            ``force_download`` when the actor is loaded from the Hub.

    Wrapping again with the same actor (the same object, registered actor, folder or Hub id, or an
    equal :class:`Actor`) or policy and the same options is a no-op; with different ones it raises
    saying what differs (call :func:`unwrap` first). After each forward ``model.dora_stats`` holds a
    :class:`~timm_dora.engine.patch.DoraStats`.

    The wrapped model keeps timm's contracts: its ``state_dict()`` is the backbone's (the actor's
    tensors live in the actor's own files), native checkpoints load into it strictly, and it
    pickles (``torch.save``, ``copy.deepcopy``) as the native model, actor and options, wrapped
    again on loading. ``torch.jit.script`` is refused in one line; ``torch.export`` works for a
    fixed plan (``policy=ReplayPolicy(plan)``) at the traced batch size and is refused otherwise.
    """
    if actor is not None and policy is not None:
        raise ValueError("pass an actor or a policy, not both")
    options = dict(readout=readout, attn_backend=attn_backend, cuda_graphs=cuda_graphs, skip_dead=skip_dead,
                   merge=bool(merge) if merge is not None else getattr(actor, "merge", False), options=options)
    if policy is not None:
        if speculate and not getattr(policy, "speculate", False):
            raise ValueError(
                "speculate=True with policy=: speculation is the policy's option, construct it with "
                "speculate=True (e.g. ActorPolicy(actor, speculate=True))"
            )
        return engine_wrap(model, policy, **options)
    if is_wrapped(model):
        return _wrap_again(model, actor, speculate, merge, options, hub_kwargs)
    check_supported(model, readout, attn_backend)  # before any download
    check_skip_dead(model, readout, skip_dead, cuda_graphs)
    with torch.inference_mode(False):  # (the policy's own tensors stay normal tensors)
        actor = _actor_for(model, actor, readout, hub_kwargs)
        if merge is None:
            options["merge"] = actor.merge  # as it was trained
        return engine_wrap(model, ActorPolicy(actor, speculate=speculate), actor=actor, **options)


def _wrap_again(model: nn.Module, actor, speculate: bool, merge: Optional[bool], options: dict, hub_kwargs) -> nn.Module:
    """:func:`wrap` of a wrapped model: a no-op with the same actor (the same object, or the same
    registered actor, folder or Hub id, or an equal :class:`Actor`) and options; else a
    ``ValueError`` saying what differs."""
    current = policy_of(model)
    if not isinstance(current, ActorPolicy):
        raise ValueError("model is already wrapped with a policy, not an actor; call timm_dora.unwrap(model) first")
    if actor is not current.actor:
        asked = _actor_for(model, actor, options["readout"], hub_kwargs)
        differ = _actor_difference(current.actor, asked)
        if differ:
            raise ValueError(f"model is already wrapped with another actor ({differ}); call timm_dora.unwrap(model) first")
    if merge is None:
        options["merge"] = current.actor.merge
    if current.speculate != speculate:
        raise ValueError(f"model is already wrapped with speculate={current.speculate} (asked: {speculate}); "
                         "call timm_dora.unwrap(model) first")
    is_wrapped_as(model, current, **options)  # (raises naming the options that differ)
    return model


def _actor_for(model: nn.Module, actor, readout: str, hub_kwargs) -> Actor:
    """The actor an ``actor`` argument names, checked against ``model``: :func:`resolve_actor` then
    the sizes, outside any ``torch.inference_mode`` (wrap may be called inside one: the actor's
    tensors must stay normal tensors)."""
    with torch.inference_mode(False):
        actor = resolve_actor(model, actor, readout=readout, **hub_kwargs)
        _check_actor(model, actor)
    return actor


def _actor_difference(current: Actor, asked: Actor) -> str:
    """What differs between the wrapped ``current`` actor and ``asked`` (``""``: they are equal, the
    weights compared in the wrapped actor's dtype)."""
    a, b = current.config(), asked.config()
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if keys:
        return "; ".join(f"{k}: {a.get(k)!r} wrapped, {b.get(k)!r} asked" for k in keys)
    mine, theirs = current.state_dict(), asked.state_dict()
    for name, t in mine.items():
        if not torch.equal(t, theirs[name].to(device=t.device, dtype=t.dtype)):
            return f"its weights differ, first at {name}"
    return ""


def _check_actor(model: nn.Module, actor: Actor) -> None:
    """The actor's sizes against the backbone's (the patch count may differ: the budget grid is read
    as fractions of it, :meth:`~timm_dora.policy.Actor.grid`)."""
    want = {
        "embed_dim": model.blocks[0].attn.qkv.out_features // 3,
        "depth": len(model.blocks),
    }
    for name, value in want.items():
        got = getattr(actor, name)
        if got != value:
            raise ValueError(f"actor does not fit this backbone: actor.{name}={got} but the model has {name}={value}")
    if actor.summary == "cls" and getattr(model, "cls_token", None) is None:
        raise ValueError("actor does not fit this backbone: it reads the CLS key (summary='cls') and the model has "
                         "no class token; Actor.for_model(model) makes one that reads the summary key")
