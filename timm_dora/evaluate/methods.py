"""The methods ``timm-dora eval`` / ``bench`` compare: native timm, DORA, the App. F.1 selector
substitutions, ToMe, PiToMe, MCTF, DiffRate, Representation Shift, Zero-TPrune, V-Pruner and static schedules, each a :class:`Method` (``outputs(x) -> {row: Output}``,
a lean ``timing_fn`` for timing, ``close`` to give the model back), made by :func:`build_method`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn

from ..api import wrap
from ..engine import is_wrapped, native_gflops, policy_of, run, unwrap
from ..engine.blocks import embed, mlp_residual
from ..engine.patch import check_skip_dead
from .baselines.selectors import SELECTORS
from .baselines.static import StaticPrune
from .baselines.diffrate import DiffRate
from .baselines.mctf import MCTF
from .baselines.pitome import PROP_ATTN as PITOME_PROP_ATTN, PiToMe
from .baselines.repshift import RepShift
from .baselines.zerotprune import ZeroTPrune
from .baselines.tome import ToMe

__all__ = ["METHODS", "Method", "NativeMethod", "DoraMethod", "SelectorMethod", "ReductionMethod", "ToMeMethod",
           "PiToMeMethod", "MCTFMethod", "DiffRateMethod", "RepShiftMethod", "ZeroTPruneMethod", "VPrunerMethod", "StaticMethod", "Output", "build_method",
           "native_forward"]

METHODS = ("native", "dora", "tome", "pitome", "mctf", "diffrate", "repshift", "zerotprune", "vpruner", "static", "random", "similarity",
           "attention-wpr")


def native_forward(model: nn.Module, x: torch.Tensor, skip_dead: bool = False) -> torch.Tensor:
    """timm's own forward, also on a wrapped model (``forward_head(forward_features(x))``).
    ``skip_dead``: the last block's MLP on the prefix tokens only (all a CLS-token readout reads),
    the blocks composed from timm's own modules."""
    if skip_dead:
        h = embed(model, x)
        for blk in model.blocks[:-1]:
            h = blk(h)
        last = model.blocks[-1]
        h = (h + last.drop_path1(last.ls1(last.attn(last.norm1(h)))))[:, : model.num_prefix_tokens]
        return model.forward_head(model.norm(mlp_residual(last, h)))
    if is_wrapped(model):
        return model.forward_head(model.forward_features(x))
    return model(x)


@dataclass
class Output:
    """One method's result on one batch."""

    logits: torch.Tensor
    gflops: torch.Tensor  # [B] per-image GFLOPs
    gate: Optional[torch.Tensor] = None  # [B, L] bool
    removed: Optional[torch.Tensor] = None  # [B, L]
    tokens: Optional[torch.Tensor] = None  # [B, L] visual tokens after each block
    backend: Optional[str] = None


def _uniform(b: int, device, gflops: float, removed: Optional[Sequence[int]] = None, n0: Optional[int] = None) -> Dict[str, Any]:
    out: Dict[str, Any] = {"gflops": torch.full((b,), float(gflops), dtype=torch.float64, device=device)}
    if removed is not None:
        r = torch.tensor(list(removed), dtype=torch.long, device=device)
        out["removed"] = r[None].expand(b, -1)
        out["gate"] = out["removed"] > 0
        out["tokens"] = (n0 - torch.cumsum(r, 0))[None].expand(b, -1)
    return out


class Method:
    """A method under evaluation: ``outputs(x) -> {row name: Output}`` and a lean ``timing_fn``."""

    name = "method"
    config: Dict[str, Any] = {}

    def outputs(self, x: torch.Tensor) -> Dict[str, Output]:
        raise NotImplementedError

    def timing_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable timed by :mod:`timm_dora.evaluate.bench` (logits only)."""
        raise NotImplementedError

    def close(self) -> None:
        """Undo what the method did to the model (e.g. unwrap)."""


def _patches(model: nn.Module, x: torch.Tensor) -> int:
    """Patches of an input ``x`` (``[B, 3, H, W]``) for ``model``'s patch embedding."""
    ph, pw = model.patch_embed.patch_size
    return (x.shape[-2] // ph) * (x.shape[-1] // pw)


def _own_size(model: nn.Module, x: torch.Tensor, method: str) -> None:
    if tuple(x.shape[-2:]) != tuple(model.patch_embed.img_size):
        raise ValueError(f"{method} is counted at the model's own input size {tuple(model.patch_embed.img_size)}, "
                         f"not {tuple(x.shape[-2:])}")


class NativeMethod(Method):
    name = "native"

    def __init__(self, model: nn.Module, skip_dead: bool = False):
        check_skip_dead(model, "model", skip_dead, False)
        self.model, self.skip_dead = model, skip_dead
        self.config = {"skip_dead": True} if skip_dead else {}
        self.gflops = {model.patch_embed.num_patches: native_gflops(model, skip_dead=skip_dead)}  # by input patch count

    def outputs(self, x):
        logits = native_forward(self.model, x, self.skip_dead)
        n0 = _patches(self.model, x)
        if n0 not in self.gflops:  # another input size (a dynamic_img_size model)
            self.gflops[n0] = native_gflops(self.model, n0, self.skip_dead)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.gflops[n0]))}

    def timing_fn(self):
        if self.skip_dead or is_wrapped(self.model):
            return lambda x: native_forward(self.model, x, self.skip_dead)
        return self.model


class DoraMethod(Method):
    """DORA with a (deterministic) actor; wraps the model in place until :meth:`close`."""

    name = "dora"

    def __init__(self, model: nn.Module, actor=None, **wrap_kwargs):
        self.model = model
        self._owns = not is_wrapped(model)
        wrap(model, actor, **wrap_kwargs)
        self.config = {"actor": actor if isinstance(actor, (str, type(None))) else type(actor).__name__}
        if wrap_kwargs.get("skip_dead"):
            self.config["skip_dead"] = True
        if wrap_kwargs.get("merge") is not None:
            self.config["merge"] = bool(wrap_kwargs["merge"])

    def _output(self, logits, s) -> Output:
        return Output(logits, s.gflops, s.gate, s.removed, s.tokens, s.backend)

    def outputs(self, x):
        logits = self.model(x)
        return {self.name: self._output(logits, self.model.dora_stats)}

    def timing_fn(self):
        return self.model

    def close(self):
        if self._owns and is_wrapped(self.model):
            unwrap(self.model)


class SelectorMethod(DoraMethod):
    """App. F.1: DORA's gates and budgets on each batch, another selector (rows: ``dora`` and it)."""

    def __init__(self, model: nn.Module, selector: str, actor=None, seed: int = 0, wpr_iters: int = 30, **wrap_kwargs):
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {tuple(SELECTORS)}, got {selector!r}")
        super().__init__(model, actor, **wrap_kwargs)
        self.cls, self.name = SELECTORS[selector], selector
        self.kwargs: Dict[str, Any] = {"model": model}
        if selector == "random":
            self.kwargs["generator"] = torch.Generator().manual_seed(seed)
        if selector == "attention-wpr":
            self.kwargs["iters"] = wpr_iters
        self.config = {**self.config, "selector": selector, "seed": seed if selector == "random" else None,
                       "wpr_iters": wpr_iters if selector == "attention-wpr" else None}

    def outputs(self, x):
        logits_d, st_d = run(self.model, x, policy_of(self.model))
        policy = self.cls.from_stats(st_d, **self.kwargs)
        logits_s, st_s = run(self.model, x, policy)
        return {"dora": self._output(logits_d, st_d), self.name: self._output(logits_s, st_s)}

    def timing_fn(self):
        raise ValueError("selector substitutions are an accuracy study (App. F.1); they have no deployment timing")


class ReductionMethod(Method):
    """A dense baseline that reduces every image alike, ``r`` tokens per block (ToMe, PiToMe, MCTF,
    DiffRate, Representation Shift, Zero-TPrune): ``fn(x) -> logits`` with ``fn.cost`` (``gflops``
    per image, the effective ``r`` per block) and ``fn.name``."""

    label = "a token-reduction baseline"

    def __init__(self, fn, r, **config):
        self.fn, self.name = fn, fn.name
        self.n0 = fn.model.patch_embed.num_patches
        self.config = {"r": r if r is None or isinstance(r, int) else list(r), "r_effective": fn.cost.r, **config,
                       **({"skip_dead": True} if fn.skip_dead else {})}

    def outputs(self, x):
        _own_size(self.fn.model, x, self.label)
        logits = self.fn(x)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.fn.cost.gflops, self.fn.cost.r, self.n0))}

    def timing_fn(self):
        return self.fn


class ToMeMethod(ReductionMethod):
    label = "ToMe"

    def __init__(self, model: nn.Module, r, prop_attn: bool = True, skip_dead: bool = False):
        fn = ToMe(model, r, prop_attn, skip_dead)
        super().__init__(fn, r, prop_attn=prop_attn, matching_gflops=fn.cost.matching_gflops)


class PiToMeMethod(ReductionMethod):
    label = "PiToMe"

    def __init__(self, model: nn.Module, r=None, prop_attn: bool = PITOME_PROP_ATTN, skip_dead: bool = False,
                 ratio: Optional[float] = None):
        fn = PiToMe(model, r, prop_attn=prop_attn, skip_dead=skip_dead, ratio=ratio)
        super().__init__(fn, r, **({"ratio": ratio} if ratio is not None else {}), prop_attn=prop_attn,
                         margin=fn.margin, alpha=fn.alpha, matching_gflops=fn.cost.matching_gflops)


class MCTFMethod(ReductionMethod):
    """MCTF off the shelf (:mod:`~timm_dora.evaluate.baselines.mctf`): an integer ``r`` fuses in
    blocks 1 to L-1 (block 0 runs unfused, as the authors' evaluation does); proportional attention
    is part of the method."""

    label = "MCTF"

    def __init__(self, model: nn.Module, r, skip_dead: bool = False):
        fn = MCTF(model, r, skip_dead=skip_dead)
        super().__init__(fn, r, extra_gflops=fn.cost.extra_gflops)


class DiffRateMethod(ReductionMethod):
    """DiffRate (:mod:`~timm_dora.evaluate.baselines.diffrate`): a learned per-block prune/merge
    schedule (a JSON from ``python -m timm_dora.evaluate.baselines.diffrate learn``, or a
    :class:`~timm_dora.evaluate.baselines.diffrate.DiffRateSchedule`), the same for every image."""

    label = "DiffRate"

    def __init__(self, model: nn.Module, schedule, skip_dead: bool = False):
        fn = DiffRate(model, schedule, skip_dead=skip_dead)
        super().__init__(fn, fn.cost.r, schedule=fn.source, prune=list(fn.schedule.prune), merge=list(fn.schedule.merge),
                         extra_gflops=fn.cost.extra_gflops)


class RepShiftMethod(ReductionMethod):
    """Representation Shift (:mod:`~timm_dora.evaluate.baselines.repshift`): the ``r`` least-shifted
    tokens pruned after each block; attention stays fused SDPA."""

    label = "Representation Shift"

    def __init__(self, model: nn.Module, r, skip_dead: bool = False):
        fn = RepShift(model, r, skip_dead=skip_dead)
        super().__init__(fn, r, where=fn.where)


class ZeroTPruneMethod(ReductionMethod):
    """Zero-TPrune (:mod:`~timm_dora.evaluate.baselines.zerotprune`): ``r`` tokens pruned per block
    by attention-graph importance and similarity."""

    label = "Zero-TPrune"

    def __init__(self, model: nn.Module, r, skip_dead: bool = False):
        fn = ZeroTPrune(model, r, skip_dead=skip_dead)
        super().__init__(fn, r, extra_gflops=fn.cost.extra_gflops)


class VPrunerMethod(ReductionMethod):
    """V-Pruner (:mod:`~timm_dora.evaluate.baselines.vpruner`): one mask of the patch positions,
    searched offline for this backbone and budget, the same for every image, applied before block 0;
    attention stays fused SDPA. ``mask``: a mask JSON file (or a
    :class:`~timm_dora.evaluate.baselines.vpruner.VPrunerMask`, or the kept positions). The ``N - K``
    deleted tokens are reported as removed at block 0."""

    label = "V-Pruner"

    def __init__(self, model: nn.Module, mask, skip_dead: bool = False):
        from .baselines.vpruner import VPruner  # here: the module is also run as python -m (its search)

        fn = VPruner(model, mask, skip_dead)
        super().__init__(fn, fn.cost.r)
        search = fn.mask.search_cost if fn.mask is not None else {}
        self.config = {"mask": fn.source, "keep": fn.cost.keep,
                       **({"search_cost": {k: search[k] for k in ("wall_s", "forward_passes", "device") if k in search}}
                          if search else {}),
                       **({"skip_dead": True} if skip_dead else {})}


class StaticMethod(Method):
    def __init__(self, model: nn.Module, schedule, rule: str = "cls_sim", skip_dead: bool = False):
        self.fn = StaticPrune(model, schedule, rule, skip_dead)
        self.name = self.fn.name
        self.n0 = model.patch_embed.num_patches
        self.ks = [self.fn.schedule.get(l, 0) for l in range(len(model.blocks))]
        self.config = {"schedule": {str(b): k for b, k in sorted(self.fn.schedule.items())}, "rule": rule,
                       **({"skip_dead": True} if skip_dead else {})}

    def outputs(self, x):
        _own_size(self.fn.model, x, "a static schedule")
        logits = self.fn(x)
        return {self.name: Output(logits, **_uniform(x.shape[0], x.device, self.fn.gflops, self.ks, self.n0))}

    def timing_fn(self):
        return self.fn


def _parse_r(r, method: str = "tome"):
    if r is None:
        raise ValueError(f"--method {method} needs --r (one value, or one per block)"
                         + (" or --ratio (fraction kept per block)" if method == "pitome" else ""))
    if isinstance(r, (list, tuple)):
        return int(r[0]) if len(r) == 1 else [int(v) for v in r]
    return int(r)


def build_method(
    model: nn.Module,
    method: str,
    *,
    actor=None,
    r=None,
    prop_attn: Optional[bool] = None,
    ratio: Optional[float] = None,
    schedule=None,
    rule: str = "cls_sim",
    seed: int = 0,
    wpr_iters: int = 30,
    attn_backend: str = "auto",
    cuda_graphs: Optional[bool] = False,
    skip_dead: bool = False,
    merge: Optional[bool] = None,
    mask=None,
) -> Method:
    """A :class:`Method` by name (see :data:`METHODS`). ``skip_dead``: every method leaves out the
    last block's MLP on the tokens a CLS-token readout never reads (and counts what runs).
    ``cuda_graphs``: how ``dora`` and the selector substitutions run DORA (``wrap``'s option: ``False``
    eager, ``None`` captured wherever it can be, as ``timm_dora.wrap`` does by default). The two
    executors run different kernels, so in bf16 a few near-tie decisions can differ between them:
    rows to be compared must use the same one. ``merge``: ``dora`` folds (``True``) or deletes
    (``False``) the removed tokens; ``None``: as the actor was trained (``wrap``'s default).
    ``prop_attn``: proportional attention for ``tome`` / ``pitome`` (``None``: the method's default,
    on for ToMe, off for PiToMe as in its authors' code). ``ratio``: ``pitome``'s own knob, the
    fraction of its visual tokens every block keeps (instead of ``r``). ``mask``: ``vpruner``'s
    searched mask (its JSON file)."""
    if ratio is not None and method != "pitome":
        raise ValueError(f"--ratio applies to pitome only, not {method}")
    if mask is not None and method != "vpruner":
        raise ValueError(f"--mask applies to vpruner, not {method}")
    if method == "native":
        return NativeMethod(model, skip_dead)
    if method == "dora":
        return DoraMethod(model, actor, attn_backend=attn_backend, cuda_graphs=cuda_graphs, skip_dead=skip_dead, merge=merge)
    if method == "tome":
        return ToMeMethod(model, _parse_r(r), True if prop_attn is None else prop_attn, skip_dead)
    if method == "pitome":
        pa = PITOME_PROP_ATTN if prop_attn is None else prop_attn
        if ratio is not None:
            if r is not None:
                raise ValueError("--method pitome takes --r or --ratio, not both")
            return PiToMeMethod(model, None, pa, skip_dead, ratio=ratio)
        return PiToMeMethod(model, _parse_r(r, method), pa, skip_dead)
    if method in ("mctf", "repshift", "zerotprune"):
        if prop_attn is not None:
            raise ValueError(f"--{'' if prop_attn else 'no-'}prop-attn applies to tome and pitome, not {method}")
        cls = {"mctf": MCTFMethod, "repshift": RepShiftMethod, "zerotprune": ZeroTPruneMethod}[method]
        return cls(model, _parse_r(r, method), skip_dead)
    if method == "vpruner":
        if mask is None:
            raise ValueError("--method vpruner needs --mask (a mask JSON from python -m timm_dora.evaluate.baselines.vpruner search)")
        if r is not None or prop_attn is not None:
            raise ValueError(f"{'--r' if r is not None else '--prop-attn/--no-prop-attn'} does not apply to vpruner "
                             "(its knob is --mask)")
        return VPrunerMethod(model, mask, skip_dead)
    if method == "diffrate":
        if not schedule:
            raise ValueError("--method diffrate needs --schedule FILE.json (a schedule learned by "
                             "python -m timm_dora.evaluate.baselines.diffrate learn)")
        if r is not None:
            raise ValueError("--r applies to tome, pitome, mctf, repshift and zerotprune, not diffrate (its schedule is --schedule)")
        if prop_attn is not None:
            raise ValueError(f"--{'' if prop_attn else 'no-'}prop-attn applies to tome and pitome, not diffrate")
        return DiffRateMethod(model, schedule, skip_dead)
    if method == "static":
        if not schedule:
            raise ValueError("--method static needs --schedule block:count[,block:count...]")
        return StaticMethod(model, schedule, rule, skip_dead)
    if method in ("random", "similarity", "attention-wpr"):
        return SelectorMethod(model, method, actor, seed=seed, wpr_iters=wpr_iters, attn_backend=attn_backend,
                              cuda_graphs=cuda_graphs, skip_dead=skip_dead)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
