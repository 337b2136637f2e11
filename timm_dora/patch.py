"""The timm integration: ``wrap`` / ``unwrap`` a timm ``VisionTransformer`` in place.

The wrapped model's ``forward`` composes each block's own submodules (``norm1``, ``attn.qkv``,
``attn.q_norm``/``k_norm``, ``attn.norm``, ``attn.proj``, ``ls1``, ``drop_path1``, ``norm2``,
``mlp``, ``ls2``, ``drop_path2``) and the model's own embedding (``patch_embed``, ``_pos_embed``,
``patch_drop``, ``norm_pre``), final ``norm`` and head, so no timm forward is copied. Per block:

1. attention on the ``P + N_l`` tokens of each image (packed; dense while lengths are equal);
2. the attention residual;
3. the policy decides from the block's keys; the chosen rows are deleted for real;
4. the MLP residual on the survivors only.

With a speculating policy (``wrap(..., speculate=True)``) steps 3-4 run in two phases: the policy
enqueues its gate and an asynchronous copy of the gate vector to the host, the MLP of the unpruned
batch is enqueued, and only then does the host wait (for the gate copy, not the MLP). When nothing
is removed that MLP is the block's output; otherwise it is discarded and step 4 runs on the
survivors. Results are identical either way.

As in ToMe, wrapping swaps the instance's class for a subclass that overrides ``forward``;
``unwrap`` puts the original class back, so native behaviour is restored bit for bit. Other
methods (``forward_features``, ``forward_head``, ``forward_intermediates``) stay timm's, unpruned:
a pruned batch has no dense ``[B, N, d]`` form.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
import os
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .actor import Actor
from .flops import BackboneCost, backbone_cost
from .packing import Packed, delete_rows, rows_where, segment_ids, select_backend, varlen_attention, BACKENDS
from .policy import ActorPolicy, BlockContext, Decision, ForwardConstants
from torch.profiler import record_function

__all__ = ["wrap", "unwrap", "is_wrapped", "set_policy", "DoraStats", "run", "READOUTS", "SUPPORTED_POOLS"]

READOUTS = ("model", "lc1")
SUPPORTED_POOLS = ("token", "avg", "max", "avgmax")
Policy = Callable[[BlockContext], Decision]


@dataclass
class DoraStats:
    """Per-forward statistics of a wrapped model (``model.dora_stats``), tensors on the model's device.

    Attributes:
        tokens: ``[B, L]`` visual tokens of each image after each block (``N_{l+1}``).
        gate: ``[B, L]`` bool, the policy intervened at that block.
        removed: ``[B, L]`` tokens removed at that block (``k_l``).
        gflops: ``[B]`` GFLOPs of the complete forward of each image, actor included (App. E.4).
        policy_gflops: ``[B]`` the policy's (actor's) share of ``gflops``.
        backend: the attention backend that ran the packed blocks.
        removed_patches: per block, ``None`` or ``(image, patch)``: two ``[R]`` int64 tensors
            naming each removed token by its image and its index in the patch grid
            (``0 .. N0-1``, row-major), for pictures of per-image trajectories.
    """

    tokens: torch.Tensor
    gate: torch.Tensor
    removed: torch.Tensor
    gflops: torch.Tensor
    policy_gflops: torch.Tensor
    backend: str
    removed_patches: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def summary(self) -> Dict[str, object]:
        """Batch means as plain Python numbers (one host sync)."""
        return {
            "gflops_mean": float(self.gflops.mean()),
            "gflops_min": float(self.gflops.min()),
            "gflops_max": float(self.gflops.max()),
            "policy_gflops_mean": float(self.policy_gflops.mean()),
            "gate_rate_per_block": self.gate.float().mean(0).tolist(),
            "tokens_mean_per_block": self.tokens.float().mean(0).tolist(),
            "backend": self.backend,
        }


class _LazyStats(DoraStats):
    """A :class:`DoraStats` computed on first access: a forward whose statistics nobody reads (a
    serving loop, a throughput benchmark) does not pay for them (about 40 small kernels)."""

    def __init__(self, compute: Callable[[], Dict[str, object]]):
        self.__dict__["_compute"] = compute

    def __getattr__(self, name: str):  # only for attributes not set yet
        if name.startswith("__") or "_compute" not in self.__dict__:
            raise AttributeError(name)
        self.__dict__.update(self.__dict__.pop("_compute")())
        return getattr(self, name)


@dataclass
class _DoraState:
    policy: Policy
    readout: str
    attn_backend: str
    cost: BackboneCost
    original_class: type
    cuda_graphs: bool = False
    graphs: "OrderedDict" = field(default_factory=OrderedDict)  # timm_dora.graphs.GraphRunner per batch shape
    warned: bool = False  # the one warning that cuda_graphs could not be used


# --------------------------------------------------------------------------------------------
# checks


def _vit_class():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer


def check_supported(model: nn.Module, readout: str = "model") -> None:
    """Raise ``TypeError``/``ValueError`` naming why ``model`` cannot be wrapped."""
    from timm.layers import Attention
    from timm.models.vision_transformer import Block

    vit = _vit_class()
    if not isinstance(model, vit):
        raise TypeError(
            f"timm_dora.wrap supports timm VisionTransformer models (ViT, DeiT, DINOv2, ...); got "
            f"{type(model).__module__}.{type(model).__name__}"
        )
    if readout not in READOUTS:
        raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
    if model.cls_token is None:
        raise ValueError("DORA's gate reads the CLS key: models without a class token are not supported")
    if getattr(model, "attn_pool", None) is not None:
        raise ValueError("attention-pool (MAP) heads are not supported: global_pool must be one of " f"{SUPPORTED_POOLS}")
    if readout == "model" and model.global_pool not in SUPPORTED_POOLS:
        raise ValueError(f"global_pool={model.global_pool!r} is not supported; use one of {SUPPORTED_POOLS}")
    if readout == "lc1":
        head = model.head
        if not isinstance(head, nn.Linear) or head.in_features != 2 * model.embed_dim:
            raise ValueError(
                "readout='lc1' concatenates CLS with the patch mean and needs model.head to be an "
                f"nn.Linear with in_features = 2 * embed_dim = {2 * model.embed_dim}"
            )
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, Block) or type(blk).forward is not Block.forward:
            raise TypeError(f"block {i} is {type(blk).__name__}; only timm's standard pre-norm Block is supported")
        if type(blk.attn) is not Attention:
            raise TypeError(f"block {i} attention is {type(blk.attn).__name__}; only timm.layers.Attention is supported")


def _check_actor(model: nn.Module, actor: Actor) -> None:
    want = {
        "embed_dim": model.blocks[0].attn.qkv.out_features // 3,
        "depth": len(model.blocks),
        "num_patches": model.patch_embed.num_patches,
    }
    for name, value in want.items():
        got = getattr(actor, name)
        if got != value:
            raise ValueError(f"actor does not fit this backbone: actor.{name}={got} but the model has {name}={value}")


# --------------------------------------------------------------------------------------------
# wrap / unwrap

_CLASSES: Dict[type, type] = {}


def _dora_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits, stats = run(self, x, self._dora.policy)
            self.dora_stats = stats
            return logits

        _CLASSES[cls] = type(f"Dora{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _CLASSES[cls]


def is_wrapped(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_dora", None), _DoraState)


def wrap(
    model: nn.Module,
    actor: Union[Actor, str, "os.PathLike[str]", None] = None,
    *,
    policy: Optional[Policy] = None,
    readout: str = "model",
    attn_backend: str = "auto",
    speculate: bool = False,
    cuda_graphs: bool = False,
    **hub_kwargs,
) -> nn.Module:
    """Patch a timm ``VisionTransformer`` in place so that its forward prunes tokens with DORA.

    Args:
        model: a timm ViT (``VisionTransformer`` or subclass, e.g. DeiT distilled, DINOv2, models
            with register tokens). Its weights are not modified.
        actor: an :class:`~timm_dora.actor.Actor`; a local folder, ``"hf-hub:org/name"`` or Hub
            repo id of a pretrained actor; or ``None`` for the actor published for the model's
            ``pretrained_cfg`` (see :mod:`timm_dora.hub`). It runs with the deterministic
            deployment rule and is registered as ``model.dora_actor``, so ``model.to(...)``
            moves it too.
        policy: instead of an actor, any policy callable (see :mod:`timm_dora.policy`).
        readout: ``"model"`` follows ``model.global_pool`` (CLS token, or ``avg``/``max``/
            ``avgmax`` over surviving patch tokens); ``"lc1"`` is DINOv2's linear readout
            (normed CLS concatenated with the mean of normed surviving patch tokens).
        attn_backend: ``"auto"`` or one of ``triton``, ``flash``, ``torch_varlen``, ``sdpa_loop``
            (:mod:`timm_dora.packing`).
        speculate: inference only, opt-in: each block enqueues its MLP on the unpruned batch
            before the host reads the actor's gate, so the GPU does not idle at that read
            (``ActorPolicy(actor, speculate=True)``). Outputs, decisions and statistics are
            identical; GFLOPs do not count the speculative MLP, which is wasted compute at blocks
            where some gate opens (and keeps the block's keys and input rows alive while it
            runs). Pays when gates rarely open. With ``policy=``, construct the policy with
            ``speculate=True`` instead (it must offer ``begin``, see :mod:`timm_dora.policy`).
        cuda_graphs: inference only, opt-in: the forward's heavy segments (embedding, each
            block's attention and MLP residuals, readout) are captured as CUDA graphs on first
            use and replayed; the decisions and the deletion run eagerly in between
            (:mod:`timm_dora.graphs`). Until the first deletion shapes are fixed by the batch
            shape and the actor's gate runs inside the graphs; after it, packed rows are padded to
            a multiple of a bucket of about 1/256 of the batch's rows (16 to 256; one graph
            per block and size). The actor's gate vector is read
            while the block's MLP on the unpruned rows replays (speculation; that MLP is wasted
            at blocks where a gate opens); where a gate opens the controller runs captured on
            every image, masked by the gate (in bf16 a near-tie may then decide differently
            from the default path). Graphs are kept
            for up to 4 batch shapes (and policies). Needs ``eval()``, no autograd
            (``torch.inference_mode()``) and, on CUDA, bf16/fp16 without autocast; otherwise the
            forward runs eagerly with one warning. The graphs read the weights in place; moving
            or casting the model recaptures. Costs memory: four ``[B*S, d]`` buffers and the
            graphs' pool per batch shape. Results match the default path up to rounding: a matrix
            product over padded rows may round differently (so a gate exactly at its threshold
            could flip). Off CUDA the same segments run uncaptured (how the CPU tests check it).
        hub_kwargs: ``revision``, ``cache_dir``, ``local_files_only``, ``token``,
            ``force_download`` when the actor is loaded from the Hub.

    Wrapping again with the same actor/policy and options is a no-op; with different ones it
    raises (call :func:`unwrap` first). After each forward ``model.dora_stats`` holds a
    :class:`DoraStats`.
    """
    if actor is not None and policy is not None:
        raise ValueError("pass an actor or a policy, not both")
    if attn_backend != "auto" and attn_backend not in BACKENDS:
        raise ValueError(f"attn_backend must be 'auto' or one of {BACKENDS}, got {attn_backend!r}")
    if policy is not None:
        _check_policy(policy)
        if speculate and not getattr(policy, "speculate", False):
            raise ValueError(
                "speculate=True with policy=: speculation is the policy's option, construct it with "
                "speculate=True (e.g. ActorPolicy(actor, speculate=True))"
            )
    if is_wrapped(model):
        state = model._dora
        current = state.policy.actor if isinstance(state.policy, ActorPolicy) else state.policy
        same_speculate = policy is not None or getattr(state.policy, "speculate", False) == speculate
        same = (state.readout, state.attn_backend, state.cuda_graphs) == (readout, attn_backend, cuda_graphs)
        if current is (actor if policy is None else policy) and same and same_speculate:
            return model
        raise ValueError("model is already wrapped with another actor/policy or options; call timm_dora.unwrap(model) first")
    check_supported(model, readout)
    if policy is None:
        from .hub import resolve_actor

        actor = resolve_actor(model, actor, readout=readout, **hub_kwargs)
        _check_actor(model, actor)
        policy = ActorPolicy(actor, speculate=speculate)
    original = type(model)
    model._dora = _DoraState(policy, readout, attn_backend, backbone_cost(model), original, bool(cuda_graphs))
    if actor is not None:
        p = next(model.parameters())
        model.add_module("dora_actor", actor.to(device=p.device, dtype=p.dtype))
    model.__class__ = _dora_class(original)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: the original class, no actor submodule, native forward."""
    if not is_wrapped(model):
        raise ValueError("model is not wrapped by timm_dora")
    model.__class__ = model._dora.original_class
    _release_graphs(model._dora)
    for name in ("dora_actor",):
        if name in model._modules:
            del model._modules[name]
    for name in ("_dora", "dora_stats"):
        if name in model.__dict__:
            delattr(model, name)
    return model


def set_policy(model: nn.Module, policy: Policy) -> None:
    """Replace the policy of a wrapped model (e.g. a sampling :class:`ActorPolicy` for training)."""
    if not is_wrapped(model):
        raise ValueError("model is not wrapped by timm_dora")
    _check_policy(policy)
    model._dora.policy = policy
    _release_graphs(model._dora)  # captured for the previous policy


def _release_graphs(state: "_DoraState") -> None:
    """Destroy a wrapped model's CUDA graphs now, not at some later garbage collection
    (:func:`timm_dora.graphs.release_all`)."""
    if state.graphs:
        from .graphs import release_all

        release_all(state.graphs)


def _check_policy(policy: Policy) -> None:
    if not callable(policy):
        raise TypeError(f"a policy must be callable as policy(ctx) -> Decision; got {type(policy).__name__}")
    if getattr(policy, "speculate", False) and not callable(getattr(policy, "begin", None)):
        raise TypeError(
            f"{type(policy).__name__} has speculate=True but does not support speculation: it needs a "
            "begin(ctx) -> finish method (see timm_dora.policy; ActorPolicy has one)"
        )


# --------------------------------------------------------------------------------------------
# the forward, composed from timm's submodules


def embed(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The model's own token embedding: ``norm_pre(patch_drop(_pos_embed(patch_embed(x))))``."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def _qk_v(attn: nn.Module, y: torch.Tensor, packed: Packed):
    """``(q, k, v)`` after ``q_norm``/``k_norm``: dense ``[B, H, S, hd]`` views on a uniform
    batch (as timm's Attention), else ``[T, H, hd]``."""
    qkv = attn.qkv(y)
    if packed.uniform:  # no per-tensor view ops
        q, k, v = qkv.view(packed.batch_size, packed.max_len, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q, k, v = qkv.view(packed.total, 3, attn.num_heads, attn.head_dim).unbind(1)
    return attn.q_norm(q), attn.k_norm(k), v


def _keys_rows(k: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Keys as ``[T, d]`` rows (heads concatenated) from :func:`_qk_v`'s layout."""
    return (k.transpose(1, 2) if packed.uniform else k).reshape(packed.total, -1)


def attention_keys(blk: nn.Module, packed: Packed) -> torch.Tensor:
    """The keys ``[T, d]`` that :func:`attention_residual` returns, recomputed from the block input
    (``norm1``, ``qkv``, ``k_norm``: the same operations, so the same values)."""
    _, k, _ = _qk_v(blk.attn, blk.norm1(packed.x), packed)
    return _keys_rows(k, packed)


def attention_residual(blk: nn.Module, packed: Packed, backend: str, out: Optional[torch.Tensor] = None,
                       attend: Optional[Callable] = None, on_keys: Optional[Callable[[torch.Tensor], None]] = None,
                       keys: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x + drop_path1(ls1(attn(norm1(x))))`` on packed rows; also returns the keys ``[T, d]``
    (``None`` when ``keys`` is false: on a uniform batch they are a transposed copy).
    ``out``: write the result there (a fixed buffer of a CUDA graph). ``attend``: ``(q, k, v) ->
    o`` (``[T, H, hd]``) instead of :func:`varlen_attention` on a non-uniform batch (the graphs'
    padded rows). ``on_keys``: called with the keys as soon as they exist (before the attention
    itself; ``[B, H, S, hd]`` on a uniform batch, else ``[T, H, hd]``): the CUDA graphs fork the
    actor's gate there, so that it runs beside the attention kernel."""
    attn = blk.attn
    t = packed.total
    y = blk.norm1(packed.x)
    q, k, v = _qk_v(attn, y, packed)
    if on_keys is not None:
        on_keys(k)
    if packed.uniform:
        o = F.scaled_dot_product_attention(q, k, v, scale=attn.scale).transpose(1, 2).reshape(t, -1)
    else:
        o = (varlen_attention(q, k, v, packed, attn.scale, backend) if attend is None else attend(q, k, v)).reshape(t, -1)
    o = attn.norm(o)
    gate = getattr(attn, "gate", None)
    if gate is not None:
        o = o * gate(y).sigmoid()
    o = attn.proj_drop(attn.proj(o))
    return torch.add(packed.x, blk.drop_path1(blk.ls1(o)), out=out), _keys_rows(k, packed) if keys else None


def mlp_residual(blk: nn.Module, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x + drop_path2(ls2(mlp(norm2(x))))`` on packed rows (into ``out`` when given)."""
    return torch.add(x, blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x)))), out=out)


def _segment_pool(packed: Packed, pool: str, include_prefix: bool) -> torch.Tensor:
    x = packed.x
    b, p = packed.batch_size, packed.num_prefix
    if include_prefix:
        rows, counts = None, packed.lengths
    else:
        rows = rows_where(packed.pos >= p, packed.total - b * p)
        counts = packed.lengths - p
    seg = packed.seg if rows is None else packed.seg[rows]
    xs = x if rows is None else x[rows]
    out = {}
    if pool in ("avg", "avgmax"):
        total = torch.zeros(b, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, seg, xs.float())
        out["avg"] = (total / counts[:, None]).to(x.dtype)
    if pool in ("max", "avgmax"):
        init = torch.full((b, x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device)
        out["max"] = init.scatter_reduce(0, seg[:, None].expand_as(xs), xs, reduce="amax")
    if pool == "avgmax":
        return 0.5 * (out["max"] + out["avg"])
    return out[pool]


def readout(model: nn.Module, packed: Packed, mode: str) -> torch.Tensor:
    """Logits from the final-normed packed tokens, as the model's own head would compute them."""
    if mode == "lc1":
        cls = packed.x[packed.starts]
        feats = torch.cat([cls, _segment_pool(packed, "avg", include_prefix=False)], dim=-1)
        return model.head(model.head_drop(feats))
    if model.global_pool == "token":
        # timm's own head on the prefix rows: CLS (and the distillation token for DeiT-distilled)
        return model.forward_head(packed.prefix_rows())
    feats = _segment_pool(packed, model.global_pool, bool(getattr(model, "pool_include_prefix", False)))
    return model.head(model.head_drop(model.fc_norm(feats)))


def _no_scope(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def run(model: nn.Module, x: torch.Tensor, policy: Policy) -> Tuple[torch.Tensor, DoraStats]:
    """The DORA forward of a wrapped ``model`` on images ``x`` with ``policy``; returns logits and stats."""
    from .graphs import RunAheadMissed

    try:
        return _run(model, x, policy, run_ahead=True)
    except RunAheadMissed:  # (CUDA graphs: a gate opened inside the dense blocks run ahead) once more,
        # block by block
        return _run(model, x, policy, run_ahead=False)


def _run(model: nn.Module, x: torch.Tensor, policy: Policy, run_ahead: bool) -> Tuple[torch.Tensor, DoraStats]:
    state: _DoraState = model._dora
    cost = state.cost
    if model.training and any(getattr(m, "drop_prob", 0.0) > 0 for m in model.modules() if type(m).__name__ == "DropPath"):
        raise RuntimeError("stochastic depth is per image and cannot act on packed rows: call model.eval() first")
    speculate = bool(getattr(policy, "speculate", False))
    if speculate:
        _check_policy(policy)
        if model.training:
            raise RuntimeError("speculate=True is an inference option (a discarded MLP would draw dropout noise): call model.eval()")
    runner = None  # the forward replayed from CUDA graphs (timm_dora.graphs), when enabled
    if state.cuda_graphs and tuple(x.shape[-2:]) == tuple(model.patch_embed.img_size):
        from .graphs import graph_mode_reason, graph_runner

        backend = select_backend(x.device.type, x.dtype, state.attn_backend)
        why = graph_mode_reason(model, x, backend)
        if why is None:
            runner = graph_runner(model, state.graphs, policy, x, backend, state.readout)
        elif not state.warned:
            state.warned = True
            # (pointing at the caller of model(x): _run, run, forward and two frames of nn.Module's call between)
            warnings.warn(f"timm_dora: cuda_graphs=True but this forward runs eagerly: {why}", stacklevel=6)
    p = model.num_prefix_tokens
    if runner is not None:
        runner.start(x, run_ahead)
        b, n0, dev = runner.batch, runner.num_patches, x.device
        packed = None
        del x
    else:
        x = embed(model, x)
        b, s, _ = x.shape
        n0 = s - p
        if n0 != cost.num_patches:
            raise ValueError(
                f"input gives {n0} patch tokens but the model (and its actor) were built for {cost.num_patches}; "
                "DORA needs the input size the model was created with"
            )
        dtype = x.dtype
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")  # attention inputs come out of autocast linears
        backend = select_backend(x.device.type, dtype, state.attn_backend)
        packed = Packed.from_dense(x, p, track_ids=True)
        dev = x.device
        del x  # the packed view is the only reference: freed once block 0 replaces it (as native does)
    depth = len(model.blocks)
    # profiler scopes only while a profiler runs (each costs two dispatcher calls otherwise)
    scope = record_function if torch.autograd._profiler_enabled() else _no_scope
    consts = ForwardConstants(b, dev)
    n_visual = torch.full((b,), n0, dtype=torch.long, device=dev)
    rho, interventions = consts.no_rho, consts.zeros
    entering, gates, removed_all, removed_patches, policy_flops = [], [], [], [], []
    scalar_flops = 0.0
    for l, blk in enumerate(model.blocks):
        speculative = None  # the MLP of the unpruned batch, enqueued before the host waits
        if runner is not None:
            with scope("dora.graphs"):
                dec, packed, mlp_done = runner.block(l, n_visual, rho, interventions, consts)
        else:
            with scope("dora.attention"):
                x_attn, keys = attention_residual(blk, packed, backend)
            ctx = BlockContext(l, keys, packed, n_visual, rho, interventions, depth, n0, backend, consts,
                               releasable=True)
            del keys
            if speculate:
                with scope("dora.policy"):
                    finish = policy.begin(ctx)  # enqueues the gate and its copy to the host
                del ctx
                with scope("dora.mlp_speculative"):
                    speculative = mlp_residual(blk, x_attn)
                with scope("dora.policy"):
                    dec = finish()  # waits for the gate copy, not for the MLP
                del finish  # frees the keys and the pre-attention rows
            else:
                with scope("dora.policy"):
                    dec = policy(ctx)
                del ctx
            packed = packed.with_x(x_attn)
            # no extra activation may outlive its use: the keys (possibly a view of the whole qkv
            # output) are dead before the MLP (before the non-speculative one), the pre-deletion
            # rows before the next attention
            del x_attn
        entering.append(n_visual)
        gates.append(dec.gate)
        removed_all.append(dec.removed)
        if isinstance(dec.flops, torch.Tensor):
            policy_flops.append(dec.flops)
        elif dec.flops is not None:
            scalar_flops += dec.flops
        if dec.gate is not consts.closed:
            interventions = interventions + dec.gate.long()
            if runner is not None and dec.remove is None:
                runner.leave_dense()  # the history changed: the dense graphs' gate assumed it did not
        if dec.remove is None:  # nothing removed: N_l unchanged, rho_{l+1} = 0
            removed_patches.append(None)
            rho = consts.no_rho
        else:
            speculative = None  # some gate opened: the speculative MLP is discarded
            rho = dec.removed.float() / n_visual.float()
            n_visual = n_visual - dec.removed
            with scope("dora.compact"):
                before = packed
                if runner is not None:
                    # the survivors' MLP replays too; the next block's history goes into the graphs'
                    # buffers before the runner waits for the deletion
                    runner.delete(l, before, dec, history=(n_visual, rho, interventions))
                    after_total = runner.cur.total
                else:
                    packed = delete_rows(before, dec.remove, dec.removed, dec.removed_host)
                    after_total = packed.total
                # which patches went, resolved only if the statistics are read (not the rows)
                removed_patches.append((before.lengths, before.total, before.ids, dec.remove, before.total - after_total))
                del before
            if runner is not None:
                continue
        if runner is not None:
            runner.mlp(l, packed, mlp_done)
        elif speculative is not None:
            packed = packed.with_x(speculative)
            del speculative
        else:
            with scope("dora.mlp"):
                packed = packed.with_x(mlp_residual(blk, packed.x))
    logits = None
    if runner is not None:
        with scope("dora.readout"):
            logits, packed = runner.finish()
    if logits is None:
        with scope("dora.readout"):
            packed = packed.with_x(model.norm(packed.x))
            logits = readout(model, packed, state.readout)
    def statistics() -> Dict[str, object]:
        # GFLOPs of every image along its trajectory, once for all blocks (App. E.4)
        removed = torch.stack(removed_all, 1)
        n_attn = torch.stack(entering, 1) + p
        own = torch.stack(policy_flops).sum(0) if policy_flops else torch.zeros(b, dtype=torch.float64, device=dev)
        if scalar_flops:
            own = own + scalar_flops  # integer-valued float64 sums: exact in any order
        flops = 2.0 * (cost.patch_macs + cost.head_macs + cost.blocks_macs(n_attn, n_attn - removed).sum(1)) + own
        patches = []
        for entry in removed_patches:
            if entry is None:
                patches.append(None)
                continue
            lengths, total, ids, remove, count = entry
            rows = rows_where(remove, count)
            patches.append((segment_ids(lengths, total)[rows], ids[rows] - p))
        return dict(tokens=n0 - removed.cumsum(1), gate=torch.stack(gates, 1), removed=removed, gflops=flops / 1e9,
                    policy_gflops=own / 1e9, backend=backend, removed_patches=patches)

    return logits, _LazyStats(statistics)
