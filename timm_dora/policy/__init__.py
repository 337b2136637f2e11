"""Policies: who decides, per image and block, whether to prune, how many tokens and which.

- :class:`Actor` (:mod:`~timm_dora.policy.actor`): DORA's actor network (App. A) and its
  distributions; :mod:`~timm_dora.policy.actor_kernels` its deterministic gate and controller as
  Triton kernels.
- :class:`ActorPolicy` (:mod:`~timm_dora.policy.actor_policy`): the actor as a policy,
  deterministic (inference) or sampled (training).
- :class:`ReplayPolicy`, :class:`NoPrune` (:mod:`~timm_dora.policy.replay`): recorded deletions,
  none.

Every policy implements the engine's protocol (:mod:`timm_dora.engine.protocol`:
``policy(ctx: BlockContext) -> Decision``), re-exported here for writing new ones.
"""
from ..engine.protocol import BlockContext, Decision, ForwardConstants
from .actor import Actor, auto_width, encoder_sizes
from .actor_policy import ActorPolicy, RolloutNoise, StepRecord
from .replay import NoPrune, ReplayPolicy

__all__ = ["Actor", "auto_width", "encoder_sizes", "ActorPolicy", "BlockContext", "Decision", "ForwardConstants", "NoPrune", "ReplayPolicy",
           "RolloutNoise", "StepRecord"]
