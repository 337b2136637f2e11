"""timm-dora: DORA token pruning for timm Vision Transformers.

    import timm, timm_dora
    model = timm.create_model("vit_tiny_patch16_224.augreg_in21k_ft_in1k", pretrained=True).eval()
    timm_dora.wrap(model)                              # the actor published for this backbone
    logits = model(images)                             # prunes, packs, runs varlen attention
    model.dora_stats.gflops                            # per-image GFLOPs of that forward

The layers, bottom up: :mod:`~timm_dora.engine` (the inference engine: timm integration, block
program and its eager and CUDA-graph executors, packing, attention kernels, FLOPs; it runs any
policy), :mod:`~timm_dora.policy` (the actor and the policies), :mod:`~timm_dora.hub` (actor files,
the published actors), then the applications: :mod:`~timm_dora.train` (PPO),
:mod:`~timm_dora.evaluate` (eval, bench, baselines) and :mod:`~timm_dora.viz` (pictures).
"""
from . import hub  # noqa: F401  (attaches Actor.from_pretrained / save_pretrained / push_to_hub)
from .api import wrap
from .engine import (DoraStats, EngineOptions, Packed, engine_info, is_wrapped, native_gflops, policy_of,
                     release_graphs, run, set_options, set_policy, unwrap)
from .policy import Actor, ActorPolicy, BlockContext, Decision, NoPrune, ReplayPolicy
from .version import __version__

__all__ = [
    "Actor",
    "ActorPolicy",
    "BlockContext",
    "Decision",
    "DoraStats",
    "EngineOptions",
    "NoPrune",
    "Packed",
    "ReplayPolicy",
    "__version__",
    "engine_info",
    "is_wrapped",
    "native_gflops",
    "policy_of",
    "release_graphs",
    "run",
    "set_options",
    "set_policy",
    "unwrap",
    "wrap",
]
