"""timm-dora: DORA token pruning for timm Vision Transformers.

    import timm, timm_dora
    model = timm.create_model("deit_base_patch16_224", pretrained=True).eval()
    actor = timm_dora.Actor.for_model(model)          # or a trained actor
    timm_dora.wrap(model, actor)
    logits = model(images)                             # prunes, packs, runs varlen attention
    model.dora_stats.gflops                            # per-image GFLOPs of that forward

Modules: :mod:`~timm_dora.actor` (the actor network and its distributions),
:mod:`~timm_dora.policy` (per-block decisions), :mod:`~timm_dora.packing` (packed batches, row
deletion, varlen attention), :mod:`~timm_dora.flops` (GFLOPs accounting), :mod:`~timm_dora.patch`
(the timm integration).
"""
from .actor import Actor
from . import hub  # noqa: F401  (attaches Actor.from_pretrained / save_pretrained / push_to_hub)
from .flops import native_gflops
from .packing import Packed
from .patch import DoraStats, is_wrapped, run, set_policy, unwrap, wrap
from .policy import ActorPolicy, BlockContext, Decision, NoPrune, ReplayPolicy

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorPolicy",
    "BlockContext",
    "Decision",
    "DoraStats",
    "NoPrune",
    "Packed",
    "ReplayPolicy",
    "is_wrapped",
    "native_gflops",
    "run",
    "set_policy",
    "unwrap",
    "wrap",
]
