"""The engine's side of a policy: what it hands a policy at each block and what it takes back.

A *policy* is any callable ``policy(ctx: BlockContext) -> Decision``. The wrapped forward calls it
once per block, after the attention residual, and deletes the rows it names before the MLP. The
policies themselves (DORA's actor, replays, ``NoPrune``) live in :mod:`timm_dora.policy`; the
engine knows only this protocol.

Speculation (opt-in): a policy whose ``speculate`` attribute is true also offers
``begin(ctx) -> finish``. ``begin`` only *enqueues* the work up to the decision's one host read
(for the actor: the gate and an asynchronous copy of the gate vector into pinned host memory,
followed by a CUDA event); the wrapped forward then enqueues the MLP of the unpruned batch and only
then calls ``finish()``, which waits for that copy (not for the MLP) and returns the same
:class:`Decision` as ``policy(ctx)``. When the decision removes nothing the speculative MLP result
is the block's output; otherwise it is discarded.

Known skips (optional): ``prunes_nothing_at(block) -> bool``, true where the call would return
``ctx.nothing()`` whatever the batch. The CUDA-graph path (:mod:`timm_dora.engine.graphs`) then
does not call the policy at those blocks and replays each run of them as one segment.
``reads_keys = False``: the policy never reads ``ctx.keys`` (the graphs then keep no keys for it).
``exportable = True``: its decisions are fixed before the forward (a recorded plan, nothing), never
read from the tensors, so ``torch.export`` and ``torch.jit.trace`` can follow the wrapped forward
(for the batch size traced); for any other policy they are refused in one line
(:data:`OPTIONAL_ATTRIBUTES`).

Decisions inside CUDA graphs (optional): a policy that can decide without host reads until the gate
vector implements :class:`CapturedPolicy` (DORA's deterministic actor does); the captured executor
(:mod:`timm_dora.engine.graphs`) then records its gate, and its controller, in the graphs. The
engine asks of a policy nothing beyond this module's declarations (a test walks its code).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

import torch

from .lazy import lazy
from .packing import Packed

__all__ = ["BlockContext", "CapturedPolicy", "Decision", "ForwardConstants", "LazyKeysContext", "OPTIONAL_ATTRIBUTES",
           "Policy"]

Policy = Callable[["BlockContext"], "Decision"]

# what the engine reads of any policy when it is there (see the module docstring)
OPTIONAL_ATTRIBUTES = ("speculate", "begin", "prunes_nothing_at", "reads_keys", "exportable")


@runtime_checkable
class CapturedPolicy(Protocol):
    """A policy whose gate and controller the captured executor records inside its CUDA graphs.

    Per block the graph runs :meth:`prepare` (what needs no keys), then :meth:`probe` (the gate, on
    the device); the host reads the gate vector once and :meth:`decide` turns the step into the
    :class:`Decision`. Where the gate opened in the last forward the graph also runs
    :meth:`controller_fixed`, the controller in fixed shapes on every image, masked by the gate.
    """

    def __call__(self, ctx: "BlockContext") -> "Decision": ...

    def probes_in_graphs(self, num_patches: int, dtype: torch.dtype) -> bool:
        """Whether this policy decides inside the graphs for a forward of ``num_patches`` patches in
        activations of ``dtype`` (else it is called as an ordinary policy between replays)."""

    def fused_gate(self, backend: str, dtype: torch.dtype) -> bool:
        """Whether its gate runs as one kernel in line after ``qkv`` for this backend and dtype
        (reading the CLS keys in place, so the graphs keep no keys for it)."""

    @property
    def context_width(self) -> int:
        """The width of the per-image context :meth:`prepare` leaves for :meth:`probe`."""

    def prepare(self, ctx: "BlockContext") -> None:
        """The part of the gate that needs no keys, memoised in ``ctx.constants``."""

    def probe(self, ctx: "BlockContext", cls_key: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> Any:
        """The gate on the device, no host reads: a step for :meth:`decide` (its ``gate`` a ``[B]``
        bool tensor: ``out`` itself when given and the gate was computed into it)."""

    def decide(self, step: Any, gate_host: List[bool], ctx: Optional["BlockContext"] = None) -> "Decision":
        """The decision from a :meth:`probe` step and its gate vector on the host."""

    def controller_fixed(self, keys: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, num_prefix: int,
                         h: torch.Tensor, n_visual: torch.Tensor, gate: torch.Tensor, block: int, backend: str,
                         lengths_host: Optional[List[int]] = None,
                         out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                         await_gate: Optional[Callable[[], None]] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The controller on every image of a packed, padded layout, masked by ``gate``: ``(remove
        [rows] bool, removed [B], flops [B])`` (into ``out`` where given). ``await_gate``: where
        given, called once, before the first work that reads ``gate`` is enqueued (the graphs
        enqueue the gate's own kernel there, so that the work before it runs beside the gate)."""


class ForwardConstants:
    """Constant ``[B]`` tensors that every block of one forward shares, created on first use.

    Policies return them instead of allocating per block; the wrapped forward recognises
    :attr:`closed` (by identity) as "no gate opened". Never write into them.
    """

    def __init__(self, batch_size: int, device: torch.device):
        self.batch_size, self.device = batch_size, device
        self.memo: Dict[object, object] = {}  # per-forward values a policy computes once (see ActorPolicy)
        # where memoised tensors must live: ``keep(*tensors) -> tensors`` (a CUDA graph runner
        # copies them into buffers outside its graphs' memory pool; see timm_dora.engine.graphs)
        self.keep: Optional[Callable[..., Tuple[torch.Tensor, ...]]] = None
        # the buffers ``keep`` copies into, for a policy that writes its memoised tensors there
        # directly (then it does not call ``keep``); ``None`` where there are none
        self.keep_into: Optional[Callable[[], Tuple[torch.Tensor, ...]]] = None

    def nothing(self, flops: Union[None, float, torch.Tensor] = None) -> "Decision":
        """The decision "no gate opened, nothing removed" (these shared constant tensors)."""
        return Decision(self.closed, self.zeros, None, flops)

    @lazy
    def zeros(self) -> torch.Tensor:
        """int64 zeros: no token removed."""
        return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)

    @lazy
    def closed(self) -> torch.Tensor:
        """bool False: the gate stayed closed for every image."""
        return torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)

    @lazy
    def opened(self) -> torch.Tensor:
        """bool True (e.g. every image has a feasible budget)."""
        return torch.ones(self.batch_size, dtype=torch.bool, device=self.device)

    @lazy
    def no_rho(self) -> torch.Tensor:
        """float32 zeros: ``rho`` after a block that removed nothing."""
        return torch.zeros(self.batch_size, dtype=torch.float32, device=self.device)


@dataclass
class BlockContext:
    """What a policy sees at block ``block`` (after the attention residual, before the MLP).

    Its tensors are valid during the policy call: with ``wrap(..., cuda_graphs=True)`` ``keys``
    and ``packed.x`` are views of buffers that later blocks overwrite; clone what must be kept.
    A policy that has read what it needs of ``keys`` may call :meth:`release_keys`.
    """

    block: int
    keys: Optional[torch.Tensor]  # [T, d] attention keys of every packed row, heads concatenated
    packed: Packed  # the batch entering this block (its layout; rows are pre-attention)
    n_visual: torch.Tensor  # [B] N_l, visual tokens entering the block
    rho: torch.Tensor  # [B] k_{l-1} / N_{l-1} (0 at l = 0)
    interventions: torch.Tensor  # [B] E_<l, earlier blocks where the gate opened
    depth: int  # L
    num_patches: int  # N0
    backend: str  # attention backend of this forward
    constants: Optional[ForwardConstants] = field(default=None, repr=False)  # shared by the forward's blocks
    # the creator (the DORA forward) lets the policy drop ``keys`` once read (:meth:`release_keys`);
    # a context made elsewhere keeps them (it may be reused after the call)
    releasable: bool = field(default=False, repr=False)
    # the block's MLP on the visual tokens is dead compute (``skip_dead`` at the last block: the
    # readout reads the prefix tokens only), so removing them here is free: a policy may decide
    # nothing (DORA's actor does not, and its training gets no reward for this block)
    dead: bool = False

    def __post_init__(self):
        if self.constants is None:
            self.constants = ForwardConstants(self.packed.batch_size, self.keys.device)

    def release_keys(self) -> None:
        """Drop this context's reference to ``keys`` (``None`` afterwards) if its creator allows
        it (``releasable``: the contexts of the DORA forward; otherwise nothing happens). On the
        eager path the keys are a view of the block's whole qkv output (three times their size),
        which is then freed before the policy's own work and the MLP, as in the native forward,
        unless the policy keeps a reference of its own."""
        if self.releasable:
            self.keys = None

    def nothing(self, flops: Union[None, float, torch.Tensor] = None) -> "Decision":
        """The decision "no gate opened, nothing removed" (shared constant tensors)."""
        return self.constants.nothing(flops)

    @property
    def n_visual_host(self) -> List[int]:
        p = self.packed.num_prefix
        return [n - p for n in self.packed.lengths_host]


@dataclass
class Decision:
    """One block's decision for every image.

    ``gate[b]``: the policy intervened on image ``b``. ``removed[b]``: tokens it removes (``k_l``,
    0 where the gate is off). ``remove``: ``[T]`` bool over the packed rows; ``None`` exactly when
    nothing is removed (``removed`` is then 0 everywhere). ``flops``: the policy's own FLOPs per
    image at this block: a ``[B]`` tensor, a float (the same for every image) or ``None`` (free).
    ``removed_host``: optional host copy of ``removed``; with it the deletion needs no host sync.
    A decision's tensors may be shared (forward constants, a replay plan's cached tensors): never
    write into them.
    """

    gate: torch.Tensor
    removed: torch.Tensor
    remove: Optional[torch.Tensor] = None
    flops: Union[None, float, torch.Tensor] = None
    removed_host: Optional[List[int]] = None  # ``removed`` as a list, when the policy knows it without a sync


class LazyKeysContext(BlockContext):
    """A :class:`BlockContext` whose ``keys`` are computed on first read (by ``keys_fn``)."""

    def __init__(self, keys_fn: Callable[[], torch.Tensor], **kwargs):
        self._keys_fn = keys_fn
        self._keys = None
        super().__init__(keys=None, **kwargs)

    @property
    def keys(self) -> Optional[torch.Tensor]:
        if self._keys is None and self._keys_fn is not None:
            self._keys = self._keys_fn()
        return self._keys

    @keys.setter
    def keys(self, value: Optional[torch.Tensor]) -> None:
        self._keys = value

    def release_keys(self) -> None:
        """As :meth:`BlockContext.release_keys`; the keys are not computed again either."""
        if self.releasable:
            self._keys, self._keys_fn = None, None
