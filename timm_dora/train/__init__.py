"""Training DORA actors with the paper's PPO recipe (Sec. 3.3-3.5, App. B-D).

- :mod:`~timm_dora.train.cli`: ``timm-dora-train`` (``python -m timm_dora.train``);
  :mod:`~timm_dora.train.config`: :class:`TrainConfig` and its flags;
- :mod:`~timm_dora.train.loop`: :class:`Trainer`, one update top to bottom (rollout, shadows,
  feedback, PPO); :mod:`~timm_dora.train.checkpoints`: saving, resuming, selecting;
- :mod:`~timm_dora.train.rollout`: sampled rollouts and complete-prefix shadow evaluations;
  :mod:`~timm_dora.train.rewards`: fidelity and compression rewards (App. B);
  :mod:`~timm_dora.train.critic`: the privileged critic (App. D.1);
  :mod:`~timm_dora.train.ppo`: GAE, PPO losses, PCGrad, hyperparameters (App. D);
  :mod:`~timm_dora.train.feedback`: closed-loop accuracy feedback (App. C);
  :mod:`~timm_dora.train.selection`: checkpoint selection on the dev split (App. E.2);
- :mod:`~timm_dora.train.pool`: the rollout pool (sampling, augmentation, prefetching);
  :mod:`~timm_dora.train.graph_step`: PPO minibatch steps replayed from CUDA graphs;
  :mod:`~timm_dora.train.runtime`: data-parallel collectives, phase clock, reproducibility.
"""
from .cli import main
from .config import RECIPES, SMALL_POOL_MAX_IMAGES, TrainConfig, build_parser, config_from_args
from .loop import Trainer

__all__ = ["RECIPES", "SMALL_POOL_MAX_IMAGES", "TrainConfig", "Trainer", "build_parser", "config_from_args", "main"]
