"""Baselines implemented in this project from their papers (no code copied).

- :mod:`~timm_dora.evaluate.baselines.tome`: ToMe token merging (bipartite soft matching, proportional
  attention, size tracking), dense and input-uniform: :func:`tome_forward`, :class:`ToMe`.
- :mod:`~timm_dora.evaluate.baselines.pitome`: PiToMe (spectrum-preserving token merging): ToMe's
  merging (without proportional attention, as its authors' code), energy-ordered bipartite matching
  in the first half of the blocks, then only the highest-energy tokens (large clusters of similar
  keys) merge and the lowest-energy ones are protected; knob ``r`` or the authors' ``ratio``:
  :func:`pitome_forward`, :class:`PiToMe`.
- :mod:`~timm_dora.evaluate.baselines.mctf`: MCTF (multi-criteria token fusion with one-step-ahead
  attention) off the shelf: similarity, informativeness and size attraction, bidirectional matching,
  attention- and size-weighted fusion: :func:`mctf_forward`, :class:`MCTF`.
- :mod:`~timm_dora.evaluate.baselines.diffrate`: DiffRate (per-block prune and merge counts learned
  on the frozen backbone by a differentiable discrete proxy; at inference tokens ranked by CLS
  attention, the least important pruned, the next merged into their most similar kept token, with
  proportional attention): :func:`diffrate_forward`, :class:`DiffRate`, :func:`learn_schedule`.
- :mod:`~timm_dora.evaluate.baselines.repshift`: Representation Shift: the tokens whose
  representation a block's MLP changed least are pruned; no attention map, so attention stays fused
  SDPA: :func:`repshift_forward`, :class:`RepShift`.
- :mod:`~timm_dora.evaluate.baselines.zerotprune`: Zero-TPrune: weighted PageRank on the attention
  graph (emphasised informative region, variance head filter) and a similarity stage pick the
  tokens to prune: :func:`zerotprune_forward`, :class:`ZeroTPrune`.
- :mod:`~timm_dora.evaluate.baselines.vpruner`: V-Pruner: one mask of the patch positions per backbone
  and budget, searched offline (Fisher prior, PPO over Plackett-Luce masks) on the pool's rollout
  images, the same for every image and applied before block 0: :func:`vpruner_forward`,
  :class:`VPruner`, :func:`search_mask`. Imported from its module only (not re-exported here), so that
  its command line, ``python -m timm_dora.evaluate.baselines.vpruner search``, runs a module that
  nothing imported before.
- :mod:`~timm_dora.evaluate.baselines.static`: dense static pruning schedules (fixed counts at fixed
  blocks; tokens chosen per image by CLS-key similarity, or sliced for a zero-overhead speed
  reference): :func:`static_forward`, :class:`StaticPrune`.
- :mod:`~timm_dora.evaluate.baselines.selectors`: the App. F.1 selector substitutions (Random,
  Similarity, Attention-WPR) as policies that replay DORA's recorded gates and budgets.

Every baseline reports GFLOPs per image under the same App. E.4 accounting as DORA.
"""
from .diffrate import DiffRate, DiffRateSchedule, diffrate_forward, diffrate_gflops, learn_schedule
from .mctf import MCTF, mctf_forward, mctf_gflops
from .repshift import RepShift, repshift_forward, repshift_gflops
from .zerotprune import ZeroTPrune, zerotprune_forward, zerotprune_gflops
from .pitome import PiToMe, energy_scores, pitome_forward, pitome_gflops, pitome_merge
from .selectors import SELECTORS, AttentionWPRSelector, RandomSelector, RecordedSelector, SimilaritySelector
from .static import StaticPrune, parse_schedule, schedule_for_reduction, static_forward, static_gflops
from .tome import ToMe, bipartite_prune, bipartite_soft_matching, proportional_attention, tome_forward, tome_gflops, tome_schedule

__all__ = [
    "SELECTORS",
    "AttentionWPRSelector",
    "DiffRate",
    "DiffRateSchedule",
    "MCTF",
    "PiToMe",
    "RepShift",
    "ZeroTPrune",
    "RandomSelector",
    "RecordedSelector",
    "SimilaritySelector",
    "StaticPrune",
    "ToMe",
    "bipartite_prune",
    "bipartite_soft_matching",
    "diffrate_forward",
    "diffrate_gflops",
    "energy_scores",
    "learn_schedule",
    "parse_schedule",
    "mctf_forward",
    "mctf_gflops",
    "pitome_forward",
    "pitome_gflops",
    "pitome_merge",
    "proportional_attention",
    "repshift_forward",
    "repshift_gflops",
    "schedule_for_reduction",
    "static_forward",
    "static_gflops",
    "tome_forward",
    "tome_gflops",
    "tome_schedule",
    "zerotprune_forward",
    "zerotprune_gflops",
]
