"""DORA's actor as a policy: :class:`ActorPolicy`.

Deterministic (inference: gate ``p >= 0.5``, largest feasible budget logit, the ``k`` highest
selector scores) or sampled (training: Bernoulli gate, masked categorical budget, Plackett-Luce
order), optionally recording what training needs (:class:`StepRecord`). It implements the
engine's policy protocol (:mod:`timm_dora.engine.protocol`) including speculation
(``speculate=True``: ``begin(ctx) -> finish``) and the hooks the CUDA-graph executor uses to run
the gate and the controller inside its graphs (``graph_probe``, ``prepare``, ``probe``,
``decide``, ``controller_fixed``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .actor_flops import actor_controller_macs, actor_gate_macs
from ..engine.attention import BACKEND_INFO, select_backend
from ..engine.packing import Packed, removal_mask, rows_where, segment_and_position, segment_ids
from ..engine.protocol import BlockContext, Decision
from .actor import Actor, gumbel_like, ordered_topk, to_padded
from .actor_kernels import fused_controller, fused_controller_reason, fused_gate, fused_gate_context

__all__ = ["ActorPolicy", "RolloutNoise", "StepRecord", "host_reader"]


@dataclass
class StepRecord:
    """What a sampled (or deterministic) actor step observed and chose, for PPO.

    Per image (``[B, ...]``): ``h``, ``cls_key``, ``gate_logit``, ``feasible``, ``gate``.
    Per gate-active image (``[A, ...]``, in ``active`` order): ``n_visual``, ``budget_logits``
    (masked), ``budget_index``, ``budget``, ``scores`` (selector scores padded with ``-inf``),
    ``order``/``valid`` (the ordered selection). ``ctrl_keys``/``ctrl_lengths``: the packed
    controller input (CLS key then visual keys of each active image).
    """

    block: int
    h: torch.Tensor
    cls_key: torch.Tensor
    gate_logit: torch.Tensor
    feasible: torch.Tensor
    gate: torch.Tensor
    active: torch.Tensor
    n_visual: Optional[torch.Tensor] = None
    ctrl_keys: Optional[torch.Tensor] = None
    ctrl_lengths: Optional[List[int]] = None
    budget_logits: Optional[torch.Tensor] = None
    budget_index: Optional[torch.Tensor] = None
    budget: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None


@dataclass
class RolloutNoise:
    """Sampling noise drawn up front per (block, image): uniforms for the gate, Gumbel noise for
    the budget and for the Plackett-Luce order (column ``j`` = the image's ``j``-th surviving
    visual token). A sampled image then gets the same draws whatever batch or process it runs in,
    which is what makes data-parallel rollouts equal to single-process ones."""

    gate: torch.Tensor  # [L, B]
    budget: torch.Tensor  # [L, B, M]
    selector: torch.Tensor  # [L, B, N0]

    @classmethod
    def draw(cls, depth: int, batch: int, num_budgets: int, num_patches: int,
             generator: Optional[torch.Generator] = None, device=None) -> "RolloutNoise":
        gate = torch.rand((depth, batch), generator=generator, device=device)
        budget = gumbel_like(torch.empty((depth, batch, num_budgets), device=device), generator)
        selector = gumbel_like(torch.empty((depth, batch, num_patches), device=device), generator)
        return cls(gate, budget, selector)

    def rows(self, index: torch.Tensor) -> "RolloutNoise":
        """The noise of images ``index`` (e.g. one process's share of a global batch)."""
        return RolloutNoise(self.gate[:, index], self.budget[:, index], self.selector[:, index])


def host_reader(t: torch.Tensor) -> Callable[[], list]:
    """Start copying ``t`` to the host; the returned callable waits for that copy only and gives
    ``t.tolist()``. On CUDA: an asynchronous copy into pinned memory followed by an event (the
    stream's later work keeps running); elsewhere a plain synchronous copy."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))

        def read() -> list:
            done.synchronize()
            return host.tolist()

        return read
    return t.cpu().tolist


class _FixedLayout(NamedTuple):
    """The parts of a :class:`Packed` layout that attention and the actor's encoder read, as
    tensors only (no host lengths): what a CUDA graph of the controller captures."""

    cu_seqlens: torch.Tensor
    max_len: int
    starts: torch.Tensor
    lengths_host: Optional[List[int]] = None  # only for the sdpa_loop backend (uncaptured)
    uniform: bool = False


@dataclass
class _GateStep:
    """What :meth:`ActorPolicy.begin` computed before the gate vector is read on the host.
    Mutable: the decision drops ``keys`` (and the context's) as soon as it has gathered the
    controller's rows, so that the block's qkv output is freed before the actor's encoder runs."""

    ctx: Optional[BlockContext]
    keys: Optional[torch.Tensor]  # in the actor's dtype
    backend: str
    h: torch.Tensor
    gate: torch.Tensor
    gate_flops: float
    rec: Optional[StepRecord]
    summary: Optional[torch.Tensor] = None  # [B, d] summary keys of a summary="mean" actor (else unused)


def summary_keys(keys: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``[B, d]`` the mean of each sequence's keys (every token entering the block, prefix
    included): what a ``summary="mean"`` actor reads in place of the CLS key. Summed in float32 in
    row order, the same way for a dense and a packed batch, so an image's summary does not depend
    on the batch around it."""
    b = packed.batch_size
    sums = torch.zeros(b, keys.shape[1], dtype=torch.float32, device=keys.device).index_add_(0, packed.seg, keys.float())
    return (sums / packed.lengths[:, None]).to(keys.dtype)


class ActorPolicy:
    """DORA's actor as a policy.

    Args:
        actor: the :class:`~timm_dora.policy.actor.Actor`.
        sample: ``False`` (default) for the deterministic deployment rule; ``True`` to sample
            gate, budget and Plackett-Luce order as in training.
        generator: random generator used when sampling.
        record: keep a :class:`StepRecord` per block in :attr:`records` (cleared by :meth:`reset`).
        noise: pre-drawn :class:`RolloutNoise` for the batch (used instead of ``generator``).
        speculate: let the wrapped forward run each block's MLP on the unpruned batch while the
            gate vector travels to the host (:meth:`begin`); decisions, outputs and statistics
            are identical, the MLP is recomputed on the survivors where a gate opens (inference
            only; pays when gates rarely open).
        fused_controller: how the deterministic rule runs the gate (every path) and the
            controller (the CUDA-graph path, :meth:`controller_fixed`): ``None`` (default) the
            Triton kernels of :mod:`timm_dora.policy.actor_kernels` where the ``triton`` attention
            backend runs, else the ``nn`` modules; ``True`` always the kernels (on CPU only in
            Triton's interpreter), ``False`` never. Sampling and recording use the modules.
    """

    def __init__(self, actor: Actor, *, sample: bool = False, generator: Optional[torch.Generator] = None,
                 record: bool = False, noise: Optional[RolloutNoise] = None, speculate: bool = False,
                 fused_controller: Optional[bool] = None):
        self.actor = actor
        if fused_controller not in (None, True, False):
            raise ValueError(f"fused_controller must be None, True or False, got {fused_controller!r}")
        self.fused_controller = fused_controller
        self.speculate = bool(speculate)
        self.sample = sample
        self.generator = generator
        self.record = record
        self.noise = noise
        self.records: List[StepRecord] = []

    def reset(self) -> None:
        self.records = []

    def _uniform(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.generator, device=device)

    def _gate_context(self, ctx: BlockContext, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(h_l [B, 3], the gate's context part [L, B, 64])`` (:meth:`Actor.gate_bias`),
        recomputed only when the history changes: the forward passes the same ``N_l``, ``rho``,
        ``E_<l`` tensors on while no token is removed."""
        state = (ctx.n_visual, ctx.rho, ctx.interventions)
        w = self.actor.gate_embed
        key = (id(self), dtype, 0 if w.is_inference() else w._version)  # (inference tensors keep no version)
        memo = ctx.constants.memo.get(key)
        if memo is not None and all(a is b for a, b in zip(memo[0], state)):
            return memo[1], memo[2]
        into = ctx.constants.keep_into() if ctx.constants.keep_into is not None else None
        if into is not None and any(t is None for t in into):
            into = None  # (not made yet: keep says why)
        if (not (self.sample or self.record) and dtype == self.actor.w_in.weight.dtype
                and self._use_fused(ctx.backend, dtype, ctx.num_patches)):
            # one Triton kernel, straight into the kept buffers where there are some
            n0 = self.actor.num_patches if ctx.num_patches is None else ctx.num_patches
            h, context = fused_gate_context(self.actor, *state, n0, dtype, out=into)
        else:
            h = self.actor.history(*state, num_patches=ctx.num_patches)
            context = self.actor.gate_bias(h, None, dtype)
            into = None
        if into is None and ctx.constants.keep is not None:
            h, context = ctx.constants.keep(h, context)
        ctx.constants.memo[key] = (state, h, context)  # holds the state tensors: their ids stay unique
        return h, context

    def __call__(self, ctx: BlockContext) -> Decision:
        step = self._gate(ctx)
        return self._decide(step, step.gate.tolist())  # the one host sync of a block

    def begin(self, ctx: BlockContext) -> Callable[[], Decision]:
        """Speculative first phase: enqueue the gate and the copy of the gate vector to the host;
        the returned ``finish()`` waits for that copy and returns ``self(ctx)``'s decision."""
        step = self._gate(ctx)
        read = host_reader(step.gate)
        return lambda: self._decide(step, read())

    @property
    def graph_probe(self) -> bool:
        """The gate and controller may run inside CUDA graphs (:mod:`timm_dora.engine.graphs`): the
        deterministic rule, nothing recorded, and none of the decision methods overridden (a
        subclass that changes them is called as an ordinary policy). Read once, when a wrapped
        model's graphs for a batch shape are made: changing ``sample``/``record`` later is not
        seen by them (``timm_dora.set_policy`` makes them anew)."""
        cls = type(self)
        plain = all(getattr(cls, m) is getattr(ActorPolicy, m)
                    for m in ("__call__", "_gate", "_decide", "prepare", "probe", "decide"))
        return plain and not (self.sample or self.record)

    def probes_in_graphs(self, num_patches: int, dtype: torch.dtype) -> bool:
        """:attr:`graph_probe` for a forward of ``num_patches`` patches in activations of ``dtype``
        (:class:`~timm_dora.engine.protocol.CapturedPolicy`): also the paper's CLS form at the
        actor's own ``N0`` (the graphs read the CLS key in place and the grid as built; a
        summary-key actor, or one at another input size, decides eagerly between replays), in the
        actor's own dtype."""
        return (self.graph_probe and self.actor.summary == "cls" and num_patches == self.actor.num_patches
                and self.actor.w_in.weight.dtype == dtype)

    @property
    def context_width(self) -> int:
        """The width of the gate's per-image context that :meth:`prepare` leaves for :meth:`probe`
        (the gate MLP's hidden width; the graphs keep a buffer of it per block)."""
        return self.actor.gate_hidden

    def fused_gate(self, backend: str, dtype: torch.dtype) -> bool:
        """Whether the deterministic gate runs the Triton kernel in line after ``qkv`` (and the
        controller its fused kernels) for this backend and dtype (:meth:`_use_fused`)."""
        return self._use_fused(backend, dtype)

    def prepare(self, ctx: BlockContext) -> None:
        """The gate's history part (``h_l`` and its share of the first layer), memoised in
        ``ctx.constants`` for the :meth:`probe` of the same history: what a CUDA graph can compute
        before the block's keys exist (:mod:`timm_dora.engine.graphs`)."""
        self._gate_context(ctx, self.actor.w_in.weight.dtype)

    def probe(self, ctx: BlockContext, cls_key: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> _GateStep:
        """The decision's device part (the gate), without host reads: what a CUDA graph captures.
        Finish with :meth:`decide`. ``cls_key``: ``[B, d]``, the CLS keys when already extracted
        (``ctx.keys`` then serves only for its width, dtype and device; the graphs pass the CLS
        keys there too), or ``[B, H, hd]`` (a view of the keys per head). ``out``: a ``[B]`` bool
        buffer the fused gate writes into (the step's ``gate`` is then ``out``)."""
        return self._gate(ctx, cls_key, out)

    def decide(self, step: _GateStep, gate_host: List[bool], ctx: Optional[BlockContext] = None) -> Decision:
        """The decision from a :meth:`probe` and its gate vector on the host. ``ctx``: the block's
        context now (the probe's own is dropped after a capture; its keys may be computed lazily)."""
        if ctx is not None:
            step = replace(step, ctx=ctx, keys=None)
        return self._decide(step, gate_host)

    def controller_fixed(self, keys: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, num_prefix: int,
                         h: torch.Tensor, n_visual: torch.Tensor, gate: torch.Tensor, block: int,
                         backend: str, lengths_host: Optional[List[int]] = None,
                         out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                         await_gate: Optional[Callable[[], None]] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The deterministic controller in fixed shapes, for a CUDA graph (:mod:`timm_dora.engine.graphs`).

        The same computation as the controller of :meth:`__call__` (encoder, budget head, selector,
        the ``k`` highest scores), run on *every* image of a packed layout whose rows may be padded
        past the last sequence (``keys``: ``[rows, d]``; ``cu_seqlens``: ``[B+1]`` int32, the real
        sequences; ``max_len``: an upper bound of their lengths) and masked by ``gate`` afterwards,
        so that no shape depends on which images opened their gate. ``h``, ``n_visual``: ``[B]``
        history and visual-token counts. ``lengths_host``: the lengths on the host, for the
        ``sdpa_loop`` backend (uncaptured, unpadded rows only). Returns ``(remove [rows] bool, removed [B], flops [B])``;
        for gate-active images the decision equals :meth:`__call__`'s up to rounding (products over
        more rows), the others remove nothing and count only the gate's FLOPs. ``out``: buffers
        for the three results (``remove`` at least ``rows`` long: its first ``rows`` entries are
        written), what the graphs keep. ``await_gate``: called before the first work that reads
        ``gate`` is enqueued (the fused kernels: before the budget head; the module path: first).
        """
        actor, p = self.actor, num_prefix
        if actor.summary != "cls":
            raise ValueError("controller_fixed reads the CLS row in place: a summary='mean' actor decides eagerly")
        b, rows, dev = gate.shape[0], keys.shape[0], keys.device
        total = rows
        if keys.dtype != actor.w_in.weight.dtype:
            keys = keys.to(actor.w_in.weight.dtype)
        if keys.stride(1) != 1:
            keys = keys.contiguous()
        cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        cu = None
        if p > 1:  # the controller reads CLS and the visual tokens only: drop the other prefix rows
            # (padded rows lie past the last sequence, so pos >= p there: the count is fixed)
            cu = cu_seqlens.long()
            _, pos = segment_and_position(cu, torch.arange(rows, device=dev))
            keys = keys[torch.nonzero_static((pos == 0) | (pos >= p), size=rows - b * (p - 1)).squeeze(1)]
            # (clamped: a zeroed layout, the unplanned whole graph's where no gate opened, stays empty)
            cu = (cu - torch.arange(b + 1, device=dev) * (p - 1)).clamp_min(0)
            rows = keys.shape[0]
            cu32 = cu.to(torch.int32)
        if self._use_fused(backend, keys.dtype):  # (each row's sequence and position found in the
            # kernels, the FLOPs in the budget kernel)
            return fused_controller(actor, keys, cu32, max_len - (p - 1), h, n_visual, gate, block, cu_seqlens, p,
                                    total, out=out, await_gate=await_gate)
        if await_gate is not None:
            await_gate()
        cu = cu_seqlens.long() if cu is None else cu
        idx = torch.arange(rows, device=dev)
        seg, pos = segment_and_position(cu, idx)
        flops = 2.0 * actor_gate_macs(actor) + torch.where(gate, 2.0 * actor_controller_macs(actor, n_visual), 0.0)
        layout = _FixedLayout(cu32, max_len - (p - 1), cu[:-1],
                              None if lengths_host is None else [n - (p - 1) for n in lengths_host])
        z = actor.encode(keys, layout, h, block, backend)
        index = actor.budget_logits(z[layout.starts], n_visual).argmax(1)
        k = torch.where(gate, actor.budgets[index], 0)
        s = actor.selector_scores(z, k.float() / n_visual.float(), seg)
        real = (pos >= 1) & (idx < cu[-1])  # visual rows of real sequences; the rest to a dump column
        n0 = actor.num_patches
        scores = to_padded(s, torch.where(real, seg, 0), torch.where(real, pos - 1, n0), b, n0 + 1, float("-inf"))
        order, valid = ordered_topk(scores[:, :n0].contiguous(), k, kmax=n0 - actor.min_keep)
        at = torch.where(valid, cu_seqlens[:-1].long()[:, None] + p + order, total)
        remove = torch.zeros(total + 1, dtype=torch.bool, device=dev).index_fill_(0, at.reshape(-1), True)[:total]
        if out is None:
            return remove, k, flops
        out[0][:total].copy_(remove)
        out[1].copy_(k)
        out[2].copy_(flops)
        return out[0][:total], out[1], out[2]

    def _use_fused(self, backend: str, dtype: torch.dtype, num_patches: Optional[int] = None) -> bool:
        """Whether the deterministic gate and :meth:`controller_fixed` run the Triton kernels of
        :mod:`timm_dora.policy.actor_kernels` (:func:`~timm_dora.policy.actor_kernels.fused_gate`,
        :func:`~timm_dora.policy.actor_kernels.fused_controller`):
        ``fused_controller=None`` (default) where the ``triton`` attention backend runs (a Hopper
        GPU, half precision) and the actor's sizes suit the kernels; ``True`` forces it (an error
        says why it cannot run), ``False`` keeps the module path."""
        if self.fused_controller is False:
            return False
        reason = fused_controller_reason(self.actor, dtype)
        if reason is None and self.actor.summary != "cls":
            reason = "the kernels read the CLS key; this actor reads the summary key"
        if reason is None and num_patches not in (None, self.actor.num_patches):
            reason = f"the kernels use the budget grid as built for {self.actor.num_patches} patches, not {num_patches}"
        if self.fused_controller is None:
            return BACKEND_INFO[backend].actor_kernels and reason is None
        if reason is not None:
            raise ValueError(f"fused_controller=True: {reason}")
        return True

    def _gate(self, ctx: BlockContext, cls_key: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> _GateStep:
        actor, packed = self.actor, ctx.packed
        b, p, dev = packed.batch_size, packed.num_prefix, ctx.keys.device
        width = ctx.keys.shape[1] if ctx.keys.dim() == 2 else ctx.keys.shape[1] * ctx.keys.shape[2]
        if width != actor.embed_dim:
            raise ValueError(f"actor expects keys of width d={actor.embed_dim}, the backbone gives {width}")
        keys, backend = ctx.keys, ctx.backend
        dtype = actor.w_in.weight.dtype
        if keys.dtype != dtype:  # e.g. an fp32 actor in training on a bf16 backbone
            keys = keys.to(dtype)
            # fp32 on CUDA: one masked fused kernel per block (as the PPO minibatches run it),
            # not one kernel per sequence
            backend = "padded" if dev.type == "cuda" else select_backend(dev.type, dtype)
        h, context = self._gate_context(ctx, dtype)
        if ctx.dead:  # (skip_dead) removing tokens here is free: no decision, no gate, no cost
            closed = ctx.constants.closed
            rec = None
            if self.record:  # a transition with no feasible action: PPO and the rewards skip it
                rec = StepRecord(ctx.block, h, keys.new_zeros(b, actor.embed_dim), torch.zeros(b, device=dev), closed,
                                 closed, torch.zeros(0, dtype=torch.long, device=dev))
                self.records.append(rec)
            return _GateStep(ctx, keys, backend, h, closed, 0.0, rec)
        n0 = ctx.num_patches
        summary = rows = None
        fused = not (self.sample or self.record) and self._use_fused(backend, dtype, n0)
        if cls_key is not None:
            cls_key = cls_key.to(dtype)
        elif actor.summary == "mean":  # (ours: no class token) the mean key stands for it
            cls_key = summary = summary_keys(keys, packed)
        elif packed.uniform and not self.record:
            cls_key = keys.view(b, packed.max_len, -1)[:, 0]  # a view: no gather while the batch is dense
        elif fused:  # the kernel reads each image's CLS row in place
            cls_key, rows = keys, packed.starts
        else:
            cls_key = keys[packed.starts]
        if fused:
            # one Triton kernel (timm_dora.policy.actor_kernels): logit >= 0 and the feasibility rule
            gate = fused_gate(actor, cls_key, context[ctx.block], ctx.n_visual, out=out, rows=rows)
            return _GateStep(ctx, keys, backend, h, gate, 2.0 * actor_gate_macs(actor), None)
        if cls_key.dim() == 3:  # [B, H, hd] (a view of the keys)
            cls_key = cls_key.reshape(b, -1)
        gate_logit = actor.gate_logit(cls_key, h, ctx.block, context[ctx.block])
        if self.sample or self.record:
            gate_logit = gate_logit.float()
        if self.sample:
            u = self.noise.gate[ctx.block] if self.noise is not None else self._uniform((b,), dev)
            gate = u < torch.sigmoid(gate_logit)
        else:
            # p^G >= 0.5 is logit >= 0 (tested without sigmoid's rounding, and in the logit's own
            # dtype: two kernels fewer per block on the inference path)
            gate = gate_logit >= 0
        if packed.min_len - p - actor.min_keep >= actor.smallest_budget(n0):  # every image has a feasible budget
            feasible = ctx.constants.opened
        else:
            feasible = actor.has_feasible_budget(ctx.n_visual, n0)
            gate = gate & feasible
        gate_flops = 2.0 * actor_gate_macs(actor)  # the same for every image
        rec = None
        if self.record:
            rec = StepRecord(ctx.block, h, cls_key, gate_logit, feasible, gate, torch.zeros(0, dtype=torch.long, device=dev))
            self.records.append(rec)
        return _GateStep(ctx, keys, backend, h, gate, gate_flops, rec, summary)

    def _decide(self, step: _GateStep, gate_host: List[bool]) -> Decision:
        """The rest of the decision once the gate vector is on the host: the controller for the
        images whose gate opened (which enter it is the host's only question)."""
        ctx, keys, backend, h, gate, gate_flops, rec = (step.ctx, step.keys, step.backend, step.h, step.gate,
                                                        step.gate_flops, step.rec)
        actor, packed = self.actor, ctx.packed
        active_host = [i for i, g in enumerate(gate_host) if g]
        if not active_host:
            return ctx.nothing(gate_flops)
        if keys is None:  # a step whose keys were dropped (decide with a new ctx): read them from it
            keys = ctx.keys
            if keys.dtype != actor.w_in.weight.dtype:
                keys = keys.to(actor.w_in.weight.dtype)
        b, p, dev = packed.batch_size, packed.num_prefix, keys.device
        active = rows_where(gate, len(active_host))

        n_host = ctx.n_visual_host
        n_act_host = [n_host[i] for i in active_host]
        n_act = ctx.n_visual[active]
        n0 = ctx.num_patches
        # visual rows of the controller batch: the j-th visual token overall, of active image a at
        # column c, sits at row j + a + 1 (a CLS row before each image's tokens)
        j = torch.arange(sum(n_act_host), device=dev)
        vseg = segment_ids(n_act, j.numel())
        vis = j + vseg + 1
        # controller input: CLS key (or summary key) + visual keys of each gate-active image, packed
        if step.summary is None:
            rows = rows_where(gate[packed.seg] & ((packed.pos == 0) | (packed.pos >= p)), sum(n_act_host) + len(active_host))
            ctrl_keys = keys[rows]
        else:
            rows = rows_where(gate[packed.seg] & (packed.pos >= p), sum(n_act_host))
            ctrl_keys = keys.new_empty(j.numel() + len(active_host), keys.shape[1])
            ctrl_keys.index_copy_(0, vis, keys[rows])
            ctrl_keys.index_copy_(0, torch.cumsum(n_act + 1, 0) - (n_act + 1), step.summary[active])
        ctrl = Packed(ctrl_keys, n_act + 1, [n + 1 for n in n_act_host], num_prefix=1)
        # the keys are not read again: on the eager path they are a view of the block's whole qkv
        # output, which would otherwise stay alive through the actor's encoder (a memory peak above
        # native's, measured on an H100). Drop every reference: this frame's, the step's
        # and the context's (the caller's frames hold only those two objects).
        del keys
        step.keys = None
        ctx.release_keys()
        z = actor.encode(ctrl.x, ctrl, h[active], ctx.block, backend)

        logits = actor.budget_logits(z[ctrl.starts], n_act, n0)
        if self.sample:
            g = self.noise.budget[ctx.block][active] if self.noise is not None else gumbel_like(logits, self.generator)
            index = (logits + g).argmax(1)
        else:
            index = logits.argmax(1)
        k = actor.grid(n0)[index]

        vcol = j - (torch.cumsum(n_act, 0) - n_act)[vseg]
        s = actor.selector_scores(z[vis], k.float() / n_act.float(), vseg)
        scores = to_padded(s, vseg, vcol, len(active_host), max(n_act_host), float("-inf"))
        noise = None
        if self.sample:
            noise = (self.noise.selector[ctx.block][active][:, : scores.shape[1]] if self.noise is not None
                     else gumbel_like(scores, self.generator))
        order, valid = ordered_topk(scores, k, noise, kmax=max(n_act_host) - actor.min_keep)  # k <= N_l - 4

        remove = removal_mask(packed, active[:, None], order, valid)
        removed = torch.zeros(b, dtype=torch.long, device=dev).index_copy_(0, active, k)
        flops = torch.full((b,), gate_flops, dtype=torch.float64, device=dev)
        flops.index_add_(0, active, 2.0 * actor_controller_macs(actor, n_act))
        if rec is not None:
            rec.active, rec.n_visual, rec.ctrl_keys, rec.ctrl_lengths = active, n_act, ctrl.x, ctrl.lengths_host
            rec.budget_logits, rec.budget_index, rec.budget = logits, index, k
            rec.scores, rec.order, rec.valid = scores, order, valid
        return Decision(gate, removed, remove, flops)
