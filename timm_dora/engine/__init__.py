"""The inference engine: a timm ViT's forward with real token deletion, packed rows and
variable-length attention. It runs any policy (:mod:`~timm_dora.engine.protocol`) and knows nothing
of training, evaluation, actors' files or the Hub.

- :mod:`~timm_dora.engine.patch`: ``wrap``/``unwrap`` (the timm integration) and the forward
  (:func:`~timm_dora.engine.patch.run`), executed eagerly;
- :mod:`~timm_dora.engine.graphs` (with :mod:`~timm_dora.engine.segments`): the same forward
  replayed from CUDA graphs; :mod:`~timm_dora.engine.capture`: which of the two runs a forward
  (captured wherever possible by default), batch buckets, fallback, ``engine_info``, ``policy_of``;
- :mod:`~timm_dora.engine.blocks`: one block's program, composed from timm's own submodules, that
  both executors run;
- :mod:`~timm_dora.engine.protocol`: what a policy sees and returns;
- :mod:`~timm_dora.engine.options`: :class:`EngineOptions`, how the engine runs a wrapped model
  (carried by it; :func:`set_options` changes them);
- :mod:`~timm_dora.engine.packing`: packed batches, row deletion; :mod:`~timm_dora.engine.attention`:
  attention within their sequences, the backends and their table;
  :mod:`~timm_dora.engine.varlen_kernel`: the Triton varlen attention kernel;
- :mod:`~timm_dora.engine.flops`: GFLOPs accounting (App. E.4).
"""
from .capture import engine_info, policy_of, release_graphs, set_options
from .flops import native_gflops
from .options import EngineOptions
from .packing import Packed
from .patch import DoraStats, is_wrapped, run, set_policy, unwrap, wrap
from .protocol import BlockContext, Decision, ForwardConstants

__all__ = ["BlockContext", "Decision", "DoraStats", "EngineOptions", "ForwardConstants", "Packed", "engine_info",
           "is_wrapped", "native_gflops", "policy_of", "release_graphs", "run", "set_options", "set_policy", "unwrap",
           "wrap"]
