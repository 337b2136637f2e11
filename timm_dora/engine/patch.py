"""The timm integration: ``wrap`` / ``unwrap`` a timm ``VisionTransformer`` in place with a policy,
and the DORA forward (:func:`run`).

The wrapped model's ``forward`` runs the block program of :mod:`~timm_dora.engine.blocks` (the
model's own submodules, nothing of timm's forward copied). Per block:

1. attention on the ``P + N_l`` tokens of each image (packed; dense while lengths are equal);
2. the attention residual;
3. the policy decides from the block's keys; the chosen rows are deleted for real;
4. the MLP residual on the survivors only.

:func:`run` drives that program through an executor, never asking which one runs: the eager one
(:mod:`~timm_dora.engine.eager`, which also states the interface) or, where
:mod:`~timm_dora.engine.capture` decides so (by default on CUDA for half-precision inference), the
captured one (:mod:`~timm_dora.engine.graphs`); batches of up to 16 (or of small dense work) run as one planned graph
(:mod:`~timm_dora.engine.whole`). The statistics (``model.dora_stats``) are computed from the
decisions when first read.

As in ToMe, wrapping swaps the instance's class for a subclass that overrides ``forward``;
``unwrap`` puts the original class back, so native behaviour is restored bit for bit. The subclass
also keeps timm's contracts (:class:`_Wrapped`): the state dict is the backbone's (the actor is
left out), and the model pickles as native model + policy + actor + options. Other
methods (``forward_features``, ``forward_head``, ``forward_intermediates``) stay timm's, unpruned:
a pruned batch has no dense ``[B, N, d]`` form.

This is the engine's ``wrap``: it takes a policy. :func:`timm_dora.wrap` also takes an actor (a
module, a folder or a Hub id) and builds the actor's policy.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .blocks import final_norm, readout
from .eager import EagerExecutor, scope
from .flops import BackboneCost, backbone_cost
from .options import EngineOptions, active, using
from .capture import batch_bucket, capture_reason, captures_under_compile, fell_back, pad_batch
from .graphs import GraphRunner, RunAheadMissed, graph_runner, release_all, rows_bucket
from .attention import BACKENDS, select_backend
from .packing import rows_where, segment_ids
from .protocol import ForwardConstants, Policy
from .whole import forward_whole, one_graph_reason, plan_from, plans, runs_whole

__all__ = ["wrap", "unwrap", "is_wrapped", "is_wrapped_as", "set_policy", "check_supported", "DoraStats", "run",
           "READOUTS", "SUPPORTED_POOLS"]

READOUTS = ("model", "lc1")
SUPPORTED_POOLS = ("token", "avg", "max", "avgmax", "map")


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
    cost: BackboneCost  # at the input size the model was created for
    original_class: type
    cuda_graphs: Optional[bool] = None  # None: captured wherever possible (engine.capture)
    graphs: "OrderedDict" = field(default_factory=OrderedDict)  # graphs.GraphRunner per batch bucket
    warned: bool = False  # the one warning that cuda_graphs=True runs eagerly
    failed: Optional[str] = None  # why capturing was given up (a captured forward raised)
    executor: Optional[str] = None  # what ran the last forward: "captured" or "eager"
    reason: Optional[str] = None  # why the last forward ran eagerly
    graph: Optional[str] = None  # how the last captured forward replayed: "whole", "planned" or "per_block"
    graph_reason: Optional[str] = None  # why it replayed a graph per block (engine.whole.one_graph_reason)
    costs: Dict[int, BackboneCost] = field(default_factory=dict)  # at other input sizes, by patch count
    skip_dead: bool = False  # the last block's MLP on the rows the readout reads only (the prefix rows)
    merge: bool = False  # removed rows folded into their most similar survivor (engine.packing.merge_removed)
    engine: Optional[EngineOptions] = None  # how the engine runs it (speed and memory only); None: the active ones

    def options(self) -> Dict[str, object]:
        """The options :func:`wrap` was given (what wrapping again must repeat)."""
        return dict(readout=self.readout, attn_backend=self.attn_backend, cuda_graphs=self.cuda_graphs,
                    skip_dead=self.skip_dead, merge=self.merge, options=self.engine)


# --------------------------------------------------------------------------------------------
# checks


def _vit_class():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer


def check_supported(model: nn.Module, readout: str = "model", attn_backend: str = "auto") -> None:
    """Raise ``TypeError``/``ValueError`` naming why ``model`` cannot be wrapped (with these options)."""
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
    if attn_backend != "auto" and attn_backend not in BACKENDS:
        raise ValueError(f"attn_backend must be 'auto' or one of {BACKENDS}, got {attn_backend!r}")
    if readout == "model" and model.global_pool not in SUPPORTED_POOLS:
        raise ValueError(f"global_pool={model.global_pool!r} is not supported; use one of {SUPPORTED_POOLS}")
    pool = getattr(model, "attn_pool", None)
    if pool is not None and getattr(pool, "pos_embed", None) is not None:
        raise ValueError("attention-pool (MAP) heads with a position embedding of their own are not supported")
    if model.cls_token is None and (readout == "lc1" or model.global_pool == "token"):
        raise ValueError(f"readout={readout!r} with global_pool={model.global_pool!r} reads the class token, "
                         "and this model has none")
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


def check_skip_dead(model: nn.Module, readout: str, skip_dead: bool, cuda_graphs: Optional[bool]) -> None:
    """``skip_dead`` needs a readout that reads the prefix rows only (the CLS token), and runs eagerly
    (``cuda_graphs=True`` is refused with it; by default such a model is not captured)."""
    if not skip_dead:
        return
    if readout != "model" or model.global_pool != "token" or getattr(model, "attn_pool", None) is not None:
        raise ValueError(f"skip_dead=True leaves out the last block's MLP on the tokens the readout never reads: "
                         f"this readout (readout={readout!r}, global_pool={model.global_pool!r}) reads every token")
    if cuda_graphs is True:
        raise ValueError("skip_dead=True is not captured in CUDA graphs yet: leave cuda_graphs unset or False with it")


# --------------------------------------------------------------------------------------------
# wrap / unwrap

_CLASSES: Dict[type, type] = {}


ACTOR = "dora_actor"  # the actor's submodule (kept out of the state dict: it lives in its own files)


class _Wrapped(nn.Module):
    """What a wrapped model's class adds to the timm class it subclasses, besides ``forward``: timm's
    contracts kept (a state dict that native checkpoints load into and that loads into the native
    model, both strictly; pickling) and one-line refusals of what cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        policy = self._dora.policy
        if torch.compiler.is_dynamo_compiling():
            if captures_under_compile(self, x):
                return _opaque_forward(self, x)  # the captured executor, one call Dynamo does not trace
        elif torch.compiler.is_exporting() or torch.jit.is_tracing():  # (asked only outside Dynamo: on
            _check_exportable(policy)  # torch 2.11 is_exporting() reads true while Dynamo traces)
        logits, stats = run(self, x, policy)
        self.dora_stats = stats
        return logits

    def state_dict(self, *args, **kwargs):
        """The backbone's state dict, as the native model has it (the actor's tensors left out)."""
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "") + ACTOR
        for key in [k for k in out if k.startswith(prefix + ".")]:
            del out[key]
        for key in [k for k in getattr(out, "_metadata", {}) if k == prefix or k.startswith(prefix + ".")]:
            del out._metadata[key]
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        actor = self._modules.get(ACTOR)
        if actor is not None:  # a checkpoint without the actor's tensors keeps the actor's own (loads strictly)
            for name, t in actor.state_dict().items():
                state_dict.setdefault(f"{prefix}{ACTOR}.{name}", t)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, ``pickle``, ``copy.deepcopy``) as the native model, the policy,
        the actor and the options, and wrapped again when loaded (this class is made at run time)."""
        state = self.__dict__.copy()
        dora = state.pop("_dora")
        state.pop("dora_stats", None)
        state["_modules"] = modules = OrderedDict(state["_modules"])
        actor = modules.pop(ACTOR, None)
        return _rewrap, (dora.original_class, state, dora.policy, actor, dora.options())

    def __prepare_scriptable__(self):  # (torch.jit.script asks this first)
        raise TypeError("torch.jit.script cannot compile a wrapped model (its forward decides token counts on the "
                        "host); use torch.compile(model), or script the native model after timm_dora.unwrap(model)")


def _check_exportable(policy: Policy) -> None:
    if not getattr(policy, "exportable", False):
        raise RuntimeError("torch.export / torch.jit.trace cannot follow a wrapped model's decisions (token counts "
                           "read from its tensors); use torch.compile(model), or a fixed plan "
                           "(policy=ReplayPolicy(plan)) at a fixed batch size")


def _rewrap(cls: type, state: Dict[str, object], policy: Policy, actor: Optional[nn.Module],
            options: Dict[str, object]) -> nn.Module:
    model = cls.__new__(cls)
    model.__setstate__(state)
    return wrap(model, policy, actor=actor, **options)


def _dora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Dora{cls.__name__}", (_Wrapped, cls), {"__module__": __name__})
    return _CLASSES[cls]


@torch.compiler.disable
def _opaque_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits, model.dora_stats = run(model, x, model._dora.policy)
    return logits


def is_wrapped(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_dora", None), _DoraState)


def is_wrapped_as(model: nn.Module, policy: Optional[Policy], *, readout: str = "model", attn_backend: str = "auto",
                  cuda_graphs: Optional[bool] = None, skip_dead: bool = False, merge: bool = False,
                  options: Optional[EngineOptions] = None) -> bool:
    """Whether ``model`` is already wrapped with exactly this policy and options (wrapping again is
    then a no-op). ``False`` if it is not wrapped; ``ValueError`` if it is wrapped otherwise (or
    ``policy`` is ``None``): :func:`unwrap` must come first."""
    if not is_wrapped(model):
        return False
    state = model._dora
    asked = dict(readout=readout, attn_backend=attn_backend, cuda_graphs=_option(cuda_graphs), skip_dead=bool(skip_dead),
                 merge=bool(merge), options=options)
    differ = [f"{k}={v!r} (asked: {asked[k]!r})" for k, v in state.options().items() if asked[k] != v]
    if state.policy is policy and not differ:
        return True
    if state.policy is not policy:
        differ.insert(0, "another policy" if policy is not None else "another actor/policy")
    raise ValueError(f"model is already wrapped with {', '.join(differ)}; call timm_dora.unwrap(model) first")


def _option(cuda_graphs: Optional[bool]) -> Optional[bool]:
    return None if cuda_graphs is None else bool(cuda_graphs)


def wrap(model: nn.Module, policy: Policy, *, readout: str = "model", attn_backend: str = "auto",
         cuda_graphs: Optional[bool] = None, skip_dead: bool = False, merge: bool = False,
         actor: Optional[nn.Module] = None, options: Optional[EngineOptions] = None) -> nn.Module:
    """Patch a timm ``VisionTransformer`` in place so that its forward prunes with ``policy``.

    The engine's wrap: :func:`timm_dora.wrap` (the public one) documents the options and builds
    the policy of an actor. ``actor``: the module the policy runs, registered as
    ``model.dora_actor`` (cast to the model's device and dtype; ``model.to(...)`` moves it too).
    ``options``: how the engine runs it (:class:`~timm_dora.engine.options.EngineOptions`; ``None``:
    the active ones at each forward, the defaults unless a :func:`~timm_dora.engine.options.using`
    block says otherwise). Wrapping again with the same policy and options is a no-op; with others
    it raises.
    """
    _check_policy(policy)
    if options is not None and not isinstance(options, EngineOptions):
        raise TypeError(f"options must be a timm_dora.EngineOptions, got {type(options).__name__}")
    if is_wrapped_as(model, policy, readout=readout, attn_backend=attn_backend, cuda_graphs=cuda_graphs,
                     skip_dead=skip_dead, merge=merge, options=options):
        return model
    check_supported(model, readout, attn_backend)
    check_skip_dead(model, readout, skip_dead, cuda_graphs)
    original = type(model)
    model._dora = _DoraState(policy, readout, attn_backend, backbone_cost(model), original, _option(cuda_graphs),
                             skip_dead=bool(skip_dead), merge=bool(merge), engine=options)
    if actor is not None:
        p = next(model.parameters())
        model.add_module(ACTOR, actor.to(device=p.device, dtype=p.dtype))
    model.__class__ = _dora_class(original)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: the original class, no actor submodule, native forward."""
    if not is_wrapped(model):
        raise ValueError("model is not wrapped by timm_dora")
    model.__class__ = model._dora.original_class
    _release_graphs(model._dora)
    if ACTOR in model._modules:
        del model._modules[ACTOR]
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
    (:func:`timm_dora.engine.graphs.release_all`)."""
    if state.graphs:
        release_all(state.graphs)


def _check_policy(policy: Policy) -> None:
    if not callable(policy):
        raise TypeError(f"a policy must be callable as policy(ctx) -> Decision; got {type(policy).__name__}")
    if getattr(policy, "speculate", False) and not callable(getattr(policy, "begin", None)):
        raise TypeError(
            f"{type(policy).__name__} has speculate=True but does not support speculation: it needs a "
            "begin(ctx) -> finish method (see timm_dora.engine.protocol; ActorPolicy has one)"
        )


# --------------------------------------------------------------------------------------------
# the forward


def run(model: nn.Module, x: torch.Tensor, policy: Policy) -> Tuple[torch.Tensor, DoraStats]:
    """The DORA forward of a wrapped ``model`` on images ``x`` with ``policy``; returns logits and
    stats. Captured or eager as :mod:`~timm_dora.engine.capture` decides (the batch padded to its
    bucket when captured, the padding's outputs dropped)."""
    state: _DoraState = model._dora
    if state.engine is None:  # (the active options: the defaults, or a using() block's)
        return _run_with_options(model, x, policy, state)
    with using(state.engine):  # (what the engine's modules read while this forward runs)
        return _run_with_options(model, x, policy, state)


def _run_with_options(model: nn.Module, x: torch.Tensor, policy: Policy, state: "_DoraState"
                      ) -> Tuple[torch.Tensor, DoraStats]:
    if x.shape[0] == 0:
        return _empty_batch(model, x)
    backend = select_backend(x.device.type, x.dtype, state.attn_backend)
    state.reason = why = capture_reason(model, x, backend)
    state.graph = state.graph_reason = None
    if why is not None:
        state.executor = "eager"
        if state.cuda_graphs and not state.warned and state.failed is None and not torch.compiler.is_compiling():
            state.warned = True
            # (pointing at the caller of model(x): this, run, forward and two frames of nn.Module's call between)
            warnings.warn(f"timm_dora: cuda_graphs=True but this forward runs eagerly: {why}", stacklevel=6)
        return _forward(model, x, policy, None)
    batch = x.shape[0]
    padded = pad_batch(x, batch_bucket(batch))
    try:
        runner = graph_runner(model, state.graphs, policy, padded, backend, state.readout, state.merge)
        if runs_whole(runner):
            state.graph = "whole"
            out = _whole(model, runner, padded, keep=batch)
        elif plans(runner):
            state.graph = "planned"
            out = _planned(model, runner, padded, keep=batch)
        else:
            state.graph, state.graph_reason = "per_block", one_graph_reason(runner)
            out = _forward(model, padded, policy, runner, keep=batch)
    except Exception as error:  # a failed capture: eagerly, and for good if that works
        release_all(state.graphs)  # (whatever the eager retry gives: a failed capture's graphs are not reused)
        out = _forward(model, x, policy, None)  # (raises if the input was at fault: graphs stay on)
        why = fell_back(model, error)
        state.executor, state.reason = "eager", f"an earlier capture failed ({why})"
        state.graph = state.graph_reason = None
        warnings.warn(f"timm_dora: capturing CUDA graphs failed, so this model runs eagerly from now on ({why}); "
                      "timm_dora.engine_info(model) keeps the reason", stacklevel=6)
        return out
    state.executor = "captured"
    return out


def _forward(model: nn.Module, x: torch.Tensor, policy: Policy, runner: Optional[GraphRunner],
             keep: Optional[int] = None, decisions: Optional[list] = None) -> Tuple[torch.Tensor, DoraStats]:
    """The block program, eager (``runner`` None) or replayed by ``runner``."""
    try:
        return _run(model, x, policy, runner, run_ahead=True, keep=keep, decisions=decisions)
    except RunAheadMissed:  # (CUDA graphs: a gate opened inside the dense blocks run ahead) once more,
        # block by block
        return _run(model, x, policy, runner, run_ahead=False, keep=keep, decisions=decisions)


def _cost_at(state: "_DoraState", model: nn.Module, num_patches: int) -> BackboneCost:
    """The model's costs at an input of ``num_patches`` patches: those of its own input size, or
    (another input size of a ``dynamic_img_size`` model) made once per size."""
    if num_patches == state.cost.num_patches:
        return state.cost
    cost = state.costs.get(num_patches)
    if cost is None:
        cost = state.costs[num_patches] = backbone_cost(model, num_patches)
    return cost


def _empty_batch(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, DoraStats]:
    """An empty batch, taken as timm takes it: ``[0, classes]`` logits (timm's own forward: there is
    nothing to prune) and statistics of zero images."""
    state: _DoraState = model._dora
    if state.readout == "lc1":
        p = next(model.parameters())
        logits = model.head(model.head_drop(torch.zeros(0, 2 * model.embed_dim, dtype=p.dtype, device=p.device)))
    else:
        logits = model.forward_head(model.forward_features(x))
    depth, dev = len(model.blocks), x.device
    counts = torch.zeros(0, depth, dtype=torch.long, device=dev)
    flops = torch.zeros(0, dtype=torch.float64, device=dev)
    backend = select_backend(dev.type, x.dtype, state.attn_backend)
    return logits, DoraStats(tokens=counts, gate=counts.bool(), removed=counts.clone(), gflops=flops,
                             policy_gflops=flops.clone(), backend=backend, removed_patches=[None] * depth)


def _statistics(cost: BackboneCost, p: int, n0: int, gate: torch.Tensor, removed: torch.Tensor, own: torch.Tensor,
                removed_patches: list, skip_dead: bool, backend: str, real: int, merge: bool = False) -> Dict[str, object]:
    """A forward's :class:`DoraStats` fields from its decisions: ``gate``, ``removed`` ``[B, L]``;
    ``own`` ``[B]`` the policy's FLOPs; per block ``None`` (no gate opened) or ``(lengths, total,
    ids, remove, count)`` of the rows before the deletion (``total``, ``count``: ints or 0-d
    tensors). Only the first ``real`` images are reported (the rest pad a captured batch).
    ``merge``: the removed rows were merged, and the matching counts
    (:meth:`~timm_dora.engine.flops.BackboneCost.match_macs`)."""
    # GFLOPs of every image along its trajectory, once for all blocks (App. E.4)
    tokens = n0 - removed.cumsum(1)
    n_attn = tokens + removed + p  # the rows entering each block's attention
    n_mlp = n_attn - removed
    if skip_dead:
        n_mlp[:, -1] = p
    macs = cost.patch_macs + cost.head_macs + cost.blocks_macs(n_attn, n_mlp).sum(1) + cost.pool_macs(n_mlp[:, -1])
    if merge:
        macs = macs + cost.match_macs(removed, tokens)
    flops = 2.0 * macs + own
    patches = []
    for entry in removed_patches:
        if entry is None:
            patches.append(None)
            continue
        lengths, total, ids, remove, count = entry
        rows = rows_where(remove, int(count))
        image, patch = segment_ids(lengths, int(total))[rows], ids[rows] - p
        if real < gate.shape[0]:  # not the padding's
            image, patch = image[image < real], patch[image < real]
        patches.append((image, patch))
    return dict(tokens=tokens[:real], gate=gate[:real], removed=removed[:real], gflops=flops[:real] / 1e9,
                policy_gflops=own[:real] / 1e9, backend=backend, removed_patches=patches)


def _planned(model: nn.Module, runner: GraphRunner, x: torch.Tensor, keep: int) -> Tuple[torch.Tensor, DoraStats]:
    """The forward as one planned graph (:mod:`~timm_dora.engine.whole`) where the runner has a plan
    and it holds; else eagerly, and the plan made or grown from that forward's decisions."""
    if runner.plan is not None:
        out = _whole(model, runner, x, keep, runner.plan)
        if out is not None:
            return out
        runner.plan_misses += 1
    decisions: list = []
    out = _forward(model, x, runner.policy, None, keep=keep, decisions=decisions)
    gates, removed = decisions
    opened = torch.stack(gates, 1).any(0).tolist()
    # (and where the plans of the model's other batch sizes run the controller, for the same policy:
    # a gate that opens rarely then costs a miss once per model, not once per batch size)
    for other in model._dora.graphs.values():
        if other is not runner and other.policy is runner.policy and other.plan is not None:
            opened = [a or b for a, b in zip(opened, other.plan.controls)]
    runner.plan = plan_from(opened, torch.stack(removed, 1).tolist(), runner.seq, rows_bucket(x.shape[0] * runner.seq),
                            old=runner.plan)
    return out


def _whole(model: nn.Module, runner: GraphRunner, x: torch.Tensor, keep: int, plan=None
           ) -> Optional[Tuple[torch.Tensor, DoraStats]]:
    """The forward as one graph (:mod:`~timm_dora.engine.whole`), planned or not (``None`` where
    ``plan`` did not hold); ``keep`` as for :func:`_run`."""
    state: _DoraState = model._dora
    out = forward_whole(runner, x, active().fused_interventions, plan)
    if out is None:
        return None
    logits, rec = out
    p, n0 = model.num_prefix_tokens, runner.num_patches
    cost = _cost_at(state, model, n0)

    def statistics() -> Dict[str, object]:
        lengths = n0 + p - rec.removed.cumsum(1) + rec.removed  # [B, L] each image's rows entering each block
        opened = rec.gate.any(0).tolist()
        patches = [(lengths[:, l], lengths[:, l].sum(), rec.ids[l], rec.remove[l], rec.removed[:, l].sum())
                   if opened[l] else None for l in range(len(opened))]
        return _statistics(cost, p, n0, rec.gate, rec.removed, rec.flops.sum(0), patches, False, runner.backend,
                           keep, state.merge)

    return (logits if keep == runner.batch else logits[:keep]), _LazyStats(statistics)


def _run(model: nn.Module, x: torch.Tensor, policy: Policy, runner: Optional[GraphRunner], run_ahead: bool,
         keep: Optional[int] = None, decisions: Optional[list] = None) -> Tuple[torch.Tensor, DoraStats]:
    """One forward, the block program driven through an executor: ``runner`` (captured) or, when
    ``None``, the eager one (:mod:`~timm_dora.engine.eager`: the interface); ``keep``: the real
    images are the first ``keep`` (the rest pad a captured batch); ``decisions``: a list that gets
    every image's gates and removals per block (lists of ``[B]`` tensors, padding included)."""
    state: _DoraState = model._dora
    if model.training and any(getattr(m, "drop_prob", 0.0) > 0 for m in model.modules() if type(m).__name__ == "DropPath"):
        raise RuntimeError("stochastic depth is per image and cannot act on packed rows: call model.eval() first")
    if getattr(policy, "speculate", False):
        _check_policy(policy)
        if model.training:
            raise RuntimeError("speculate=True is an inference option (a discarded MLP would draw dropout noise): call model.eval()")
    p, dev = model.num_prefix_tokens, x.device
    ex = runner if runner is not None else EagerExecutor(model, policy, state.attn_backend, state.skip_dead, state.merge)
    ex.start(x, run_ahead)
    del x  # (eager: the packed rows are the only reference, freed once block 0 replaces them)
    b, n0, backend = ex.batch, ex.num_patches, ex.backend
    cost = _cost_at(state, model, n0)
    consts = ForwardConstants(b, dev)
    n_visual = torch.full((b,), n0, dtype=torch.long, device=dev)
    rho, interventions = consts.no_rho, consts.zeros
    gates, removed_all, removed_patches, policy_flops = [], [], [], []
    scalar_flops = 0.0
    for l in range(len(model.blocks)):
        with scope("dora.block"):
            dec, mlp_done = ex.block(l, n_visual, rho, interventions, consts)
        gates.append(dec.gate)
        removed_all.append(dec.removed)
        if isinstance(dec.flops, torch.Tensor):
            policy_flops.append(dec.flops)
        elif dec.flops is not None:
            scalar_flops += dec.flops
        if dec.gate is not consts.closed:
            interventions = interventions + dec.gate.long()
            if dec.remove is None:
                ex.leave_dense()  # the history changed (the captured dense graphs' gate assumed it did not)
        if dec.remove is None:  # nothing removed: N_l unchanged, rho_{l+1} = 0
            removed_patches.append(None)
            rho = consts.no_rho
            ex.mlp(l, mlp_done)
            continue
        rho = dec.removed.float() / n_visual.float()
        n_visual = n_visual - dec.removed
        before = ex.attended
        entry = (before.lengths, before.total, before.ids, dec.remove)  # the layout only, not the rows
        del before
        # the deletion and the survivors' MLP (captured: the next block's history goes into the
        # graphs' buffers before the runner waits for the deletion)
        total = ex.delete(l, dec, history=(n_visual, rho, interventions))
        # which patches went, resolved only if the statistics are read
        removed_patches.append(entry + (entry[1] - total,))
    with scope("dora.readout"):
        logits, final = ex.finish()
        if logits is None:  # the readout over the final rows (pooled readouts are not captured)
            logits = readout(model, final.with_x(final_norm(model, final.x)), state.readout)
    del final

    def statistics() -> Dict[str, object]:
        own = torch.stack(policy_flops).sum(0) if policy_flops else torch.zeros(b, dtype=torch.float64, device=dev)
        if scalar_flops:
            own = own + scalar_flops  # integer-valued float64 sums: exact in any order
        return _statistics(cost, p, n0, torch.stack(gates, 1), torch.stack(removed_all, 1), own, removed_patches,
                           state.skip_dead, backend, real, state.merge)

    real = b if keep is None else keep
    if decisions is not None:
        decisions[:] = [gates, removed_all]
    return (logits if real == b else logits[:real]), _LazyStats(statistics)
