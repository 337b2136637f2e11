"""A training run's configuration (:class:`TrainConfig`: every setting named once, the paper's
defaults or marked ours) and the ``timm-dora-train`` flags made from it (one flag per field).

Seven settings come from a *recipe* unless given (:data:`RECIPES`): the paper's (App. D.4), or ours
for small image pools (``small-pool``: label-free feedback read on every pool image at each check,
fitted checkpoint selection; ``docs/training_rounds.md``, third and fourth rounds). ``--recipe
auto``, the default, picks ``small-pool`` for a rollout split of at most
:data:`SMALL_POOL_MAX_IMAGES` images (the paper's feedback reads 2,048-image QC shards; 150 images
cannot measure its 1 pp target) and the paper's otherwise; a flag given explicitly always wins."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from ..policy.actor import encoder_sizes
from ..version import __version__
from .feedback import SIGNALS
from .images import ROLLOUT_DATA
from .pool import AUGMENT_LEVELS, SMALL_POOL_MAX_IMAGES
from .ppo import PPOConfig
from .selection import RULES

__all__ = ["TrainConfig", "build_parser", "check_resume", "config_from_args", "RECIPES", "SMALL_POOL_MAX_IMAGES"]

# the settings a recipe fills when they are not given (None in TrainConfig)
RECIPES = {
    "paper": {"feedback_signal": "drop", "target_disagreement": 0.06, "qc_with_rollout": False, "qc_with_dev": False,
              "qc_shards": 8, "selection": "min", "checkpoint_every": 50},
    "small-pool": {"feedback_signal": "disagreement", "target_disagreement": 0.08, "qc_with_rollout": True,
                   "qc_with_dev": True, "qc_shards": 1, "selection": "fit", "checkpoint_every": 100},
}


@dataclass
class TrainConfig:
    """Everything a training run needs; defaults are the paper's (``ppo``) or marked ours."""

    model: str  # timm model name, e.g. vit_tiny_patch16_224.augreg_in21k_ft_in1k
    data: str  # labels CSV (path,label,...,split) or an ImageFolder root for the rollout split
    out: str  # output directory (config.json, metrics.jsonl, checkpoints/, state.pt, selected/)
    weights: Optional[str] = None  # local weights file (timm pretrained_cfg_overlay)
    pretrained: bool = False  # let timm fetch the pretrained weights instead
    random_backbone: bool = False  # train on a randomly initialised backbone (tests, speed runs): needed without --weights or --pretrained
    img_size: Optional[int] = None  # override the model's input size (small tests)
    num_classes: Optional[int] = None  # the classifier's classes (default: the model's)
    rollout_split: str = "rollout"  # the labels CSV split the rollouts draw from
    qc_split: str = "qc"  # the split of the feedback checks (App. C)
    dev_split: str = "dev"  # the split the checkpoints are selected on
    qc_data: Optional[str] = None  # a separate ImageFolder root for the qc split (default: --data with the split)
    dev_data: Optional[str] = None  # a separate ImageFolder root for the dev split
    augment: str = "none"  # ours, for small pools: "none" | "light" | "strong" (pool.train_transform; True = "light")
    cutmix_prob: float = 0.5  # ours: with --augment strong, the share of rollout images given a patch CutMix from another pool image
    actor_width: Optional[int] = None  # the actor's encoder width (paper: 128); heads, FFN and selector follow it (actor.encoder_sizes); None (ours): --init-actor's, else policy.auto_width (64 for Tiny backbones, 128 from ViT-S up)
    budget_step: int = 2  # the budget grid {s, 2s, ..., N0 - 4} of actor and critic (paper: 2)
    recipe: str = "auto"  # where the None settings below come from: "paper", "small-pool" (ours) or "auto" (by the rollout split's size)
    selection: Optional[str] = None  # "min" (paper: lowest dev GFLOPs within the target) or "fit" (ours: on fitted drops)
    skip_dead: bool = False  # ours: the last block's MLP on the prefix tokens only (CLS readouts) and no decision there
    merge: bool = False  # ours: the removed tokens merged into their most similar survivors (ToMe's proportional attention), not deleted
    init_actor: Optional[str] = None  # warm start from a saved actor (folder or Hub id); critic, optimizers, feedback fresh
    readout: str = "model"  # "model" (the model's global_pool) or "lc1" (DINOv2's linear readout)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"  # where to train
    target_drop: float = 0.01  # the feedback's target top-1 drop on the QC shards (paper: 1 pp)
    a_init: float = 30.0  # the fidelity coefficient a_u at the start (App. C)
    fixed_coefficient: bool = False  # ablation: a_u stays a_init (no feedback)
    terminal_only: bool = False  # ablation: the fidelity cost at the last step only
    feedback_cadence: int = 8  # updates between feedback checks (paper: 8)
    qc_shards: Optional[int] = None  # round-robin QC shards of the feedback checks (paper: 8)
    qc_with_rollout: Optional[bool] = None  # ours: the feedback checks read the rollout pool's images too (eval preprocessing)
    qc_with_dev: Optional[bool] = None  # ours: with --feedback-signal disagreement (label-free), the checks read the dev images too
    rollout_with_checks: bool = False  # ours: the rollouts draw from the qc and dev images too (rewards read no labels); only with --feedback-signal disagreement; the dev selection then reads images the actor trained on
    feedback_ema: float = 0.0  # ours: weight of the past in a moving average of the checks' drops (0: the paper's rule)
    feedback_signal: Optional[str] = None  # "drop" (paper: paired top-1 drop on the QC labels) or "disagreement" (ours: share of QC images whose top-1 differs from native's, label-free)
    target_disagreement: Optional[float] = None  # ours: the disagreement the feedback holds with --feedback-signal disagreement (its error is normalised by target_disagreement / target_drop x 0.01)
    tau_b: float = 0.1  # ours: low-margin threshold of the critic's phi^N (paper: backbone-specific, unstated)
    checkpoint_every: Optional[int] = None  # (paper: 50)
    max_minutes: float = 0.0  # stop early (checkpoint, select) after this wall time; 0: no limit
    data_workers: Optional[int] = None  # ours: processes making the rollout batches ahead of the update (None: this process's share of the host's cores less two, at least 1; 0: none, made in the training process)
    rollout_data: str = "auto"  # ours: "stream" (read from the files by the workers for every update), "held" (decoded once, held on the device as uint8; no --augment) or "auto" (held for at most SMALL_POOL_MAX_IMAGES images without augmentation, else stream)
    shadow_chunk: int = 2048  # shadow rows per packed forward (memory only: each row is computed alone)
    eval_batch: int = 256  # images per batch of the QC and dev evaluations
    tensorboard: bool = False  # also log to OUT/tensorboard (needs the tensorboard package)
    progress: bool = True  # a progress line per update on stderr
    cuda_graphs: bool = True  # ours: replay the PPO minibatch steps from CUDA graphs (CUDA; also data parallel)
    overlap: bool = True  # ours: with cuda_graphs, an update's critic steps run on a second stream beside the next update's rollout (the same steps in the same order)
    compile: Optional[bool] = None  # ours: torch.compile (Inductor) the critic's token branch; None: on CUDA only
    critic_bf16: Optional[bool] = None  # ours: the critic's token branch under bf16 autocast (fp32 weights, Adam, heads, losses); None: on CUDA only
    batch_scale: int = 1  # ours, for N GPUs: N x the rollout images and minibatches per update (each process the paper's batch), 1/N of the updates, feedback checks and checkpoints (rounded up); 1: the paper's update (split over the processes)
    ppo: PPOConfig = field(default_factory=PPOConfig)

    @property
    def total_updates(self) -> int:
        return self.ppo.updates

    @property
    def feedback_rule(self) -> Tuple[float, float]:
        """``(target, scale)`` of the feedback rule: the paper's ``(target_drop, 0.01)``, or (ours, with
        ``--feedback-signal disagreement``) ``target_disagreement`` with the same fraction of it as
        scale, ``0.01 x target_disagreement / target_drop``: the disagreement target reads as the
        drop target would."""
        if self.feedback_signal == "drop":
            return self.target_drop, 0.01
        return self.target_disagreement, 0.01 * self.target_disagreement / self.target_drop

    def resolved(self, rollout_images: int, actor_width: int) -> "TrainConfig":
        """This configuration with its recipe chosen (``auto``: ``small-pool`` for at most
        :data:`SMALL_POOL_MAX_IMAGES` rollout images, else ``paper``), every setting left ``None``
        taken from it, ``actor_width`` where none was given, and :attr:`batch_scale` applied
        (:meth:`scaled`): apply it once, to the configuration as given (``config.json`` holds the
        result, which is not to be resolved again)."""
        name = self.recipe
        if name == "auto":
            name = "small-pool" if rollout_images <= SMALL_POOL_MAX_IMAGES else "paper"
        fill = {k: v for k, v in RECIPES[name].items() if getattr(self, k) is None}
        return dataclasses.replace(self, recipe=name, actor_width=self.actor_width or actor_width, **fill).scaled()

    def scaled(self) -> "TrainConfig":
        """This configuration with :attr:`batch_scale` ``K`` applied: ``K`` x the rollout images and
        the three minibatches (the same optimiser steps per update, on ``K`` x the transitions, drawn
        evenly from ``K`` blocks of the images: ``K`` x :attr:`~.ppo.PPOConfig.strata`), and
        the updates, the feedback cadence and the checkpoint cadence divided by ``K``, rounded up
        (settings still ``None`` stay so). The run reads the same images as ``K = 1`` and checks them
        at the same image counts: on ``K`` GPUs every process does one GPU's update. That is a
        larger-batch PPO, not the paper's update (``benchmarks/batch_scale.py`` measures what it
        learns). ``K = 1`` returns the configuration unchanged."""
        k = self.batch_scale
        if not isinstance(k, int) or isinstance(k, bool):
            raise ValueError(f"--batch-scale must be an integer, got {k!r}")
        if k < 1:  # (as _check_numbers says it)
            raise ValueError(f"--batch-scale must be at least 1, got {k}")
        if k == 1:
            return self
        p = self.ppo
        updates = -(-p.updates // k)
        ppo = dataclasses.replace(p, rollout_images=k * p.rollout_images, updates=updates, strata=k * p.strata,
                                  total_images=k * p.rollout_images * updates, gate_minibatch=k * p.gate_minibatch,
                                  controller_minibatch=k * p.controller_minibatch, critic_minibatch=k * p.critic_minibatch)
        every = None if self.checkpoint_every is None else -(-self.checkpoint_every // k)
        return dataclasses.replace(self, ppo=ppo, feedback_cadence=-(-self.feedback_cadence // k), checkpoint_every=every)

    def check(self) -> "TrainConfig":
        """This configuration, after a ``ValueError`` naming the flag of any setting out of range
        (settings still ``None`` wait for :meth:`resolved`)."""
        if not (self.weights or self.pretrained or self.random_backbone):
            raise ValueError("no backbone weights: pass --weights FILE or --pretrained (timm fetches them); "
                             "--random-backbone trains on random weights (tests, speed runs only)")
        if self.random_backbone and (self.weights or self.pretrained):
            raise ValueError("--random-backbone with --weights or --pretrained: choose one")
        _check_numbers(self)
        if self.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        if self.recipe not in ("auto", *RECIPES):
            raise ValueError(f"--recipe must be one of {('auto', *RECIPES)}, got {self.recipe!r}")
        try:
            if self.actor_width is not None:
                encoder_sizes(self.actor_width)
        except ValueError as e:
            raise ValueError(f"--actor-width: {e}") from None
        p = self.ppo
        if p.rollout_images % p.strata:
            raise ValueError(f"--rollout-images {p.rollout_images} must be divisible by --strata {p.strata}")
        small = [f for f in ("gate_minibatch", "controller_minibatch", "critic_minibatch") if getattr(p, f) < p.strata]
        if small:
            raise ValueError(f"--{small[0].replace('_', '-')} {getattr(p, small[0])} must be at least --strata {p.strata}")
        if not 0.0 <= self.cutmix_prob <= 1.0:
            raise ValueError(f"--cutmix-prob must be in [0, 1], got {self.cutmix_prob}")
        if self.selection is not None and self.selection not in RULES:
            raise ValueError(f"--selection must be one of {RULES}, got {self.selection!r}")
        if self.feedback_signal is not None and self.feedback_signal not in SIGNALS:
            raise ValueError(f"--feedback-signal must be one of {SIGNALS}, got {self.feedback_signal!r}")
        if self.target_disagreement is not None and not self.target_disagreement < 1.0:  # (above 0: _check_numbers)
            raise ValueError(f"--target-disagreement must be below 1, got {self.target_disagreement}")
        if self.qc_with_dev and self.feedback_signal not in (None, "disagreement"):
            raise ValueError("--qc-with-dev reads the dev images at every feedback check: only with --feedback-signal "
                             "disagreement, which reads no labels, so that the dev labels stay for the selection alone")
        if self.rollout_with_checks and self.feedback_signal not in (None, "disagreement"):
            raise ValueError("--rollout-with-checks trains on the qc images: only with --feedback-signal disagreement, "
                             "whose checks read no labels (the paper's drop signal reads the qc labels)")
        if self.rollout_data not in ROLLOUT_DATA:
            raise ValueError(f"--rollout-data must be one of {ROLLOUT_DATA}, got {self.rollout_data!r}")
        return self


POSITIVE = ("lr_gate", "lr_critic", "lr_shared", "lr_budget", "lr_selector", "clip_eps", "kd_temperature", "value_clip",
            "huber_delta", "max_grad_norm", "adv_eps", "pcgrad_eps", "target_drop", "target_disagreement")  # floats above 0
AT_MOST_ONE = ("gamma", "gae_lambda")


def _check_numbers(cfg: "TrainConfig") -> None:
    """A ``ValueError`` naming the flag of the first number out of range: every count at least 1
    (``--data-workers`` 0 or more; ``--seed`` any), every float finite and 0 or more (above 0 for
    :data:`POSITIVE`, at most 1 for :data:`AT_MOST_ONE`, ``--feedback-ema`` below 1)."""
    for obj in (cfg, cfg.ppo):
        for f in dataclasses.fields(obj):
            v, flag = getattr(obj, f.name), "--" + f.name.replace("_", "-")
            if v is None or isinstance(v, bool) or f.name in ("seed", "total_images") or not isinstance(v, (int, float)):
                continue
            if isinstance(v, int) and v < (0 if f.name == "data_workers" else 1):
                raise ValueError(f"{flag} must be at least {0 if f.name == 'data_workers' else 1}, got {v}")
            if isinstance(v, float) and (not math.isfinite(v) or v < 0 or (v == 0 and f.name in POSITIVE)):
                raise ValueError(f"{flag} must be {'above' if f.name in POSITIVE else 'at least'} 0, got {v}")
            if (f.name in AT_MOST_ONE and v > 1) or (f.name == "feedback_ema" and v >= 1):
                raise ValueError(f"{flag} must be {'below' if f.name == 'feedback_ema' else 'at most'} 1, got {v}")


def check_resume(cfg: "TrainConfig", saved: Dict) -> None:
    """``--resume``: a ``ValueError`` naming every setting given now that differs from the run's
    ``config.json`` (settings left to the recipe are not compared; :data:`RESUMABLE` may change)."""
    now = dataclasses.asdict(cfg.scaled())  # (config.json holds the scaled settings)
    pairs = [(k, v, saved.get(k)) for k, v in now.items() if k != "ppo"]
    ppo_defaults = dataclasses.asdict(PPOConfig())  # (a run from before a setting existed: its default)
    pairs += [(k, v, saved.get("ppo", {}).get(k, ppo_defaults[k])) for k, v in now["ppo"].items()]
    differ = [f"--{k.replace('_', '-')} {v!r} (the run: {old!r})" for k, v, old in pairs
              if k not in (*RESUMABLE, "total_images") and v is not None and not (k == "recipe" and v == "auto")
              and json.loads(json.dumps(v)) != old]
    if differ:
        raise ValueError(f"--resume: {'; '.join(differ)} differ from {cfg.out}/config.json; only "
                         f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE)} may change")


# the --help groups, in order (every TrainConfig field in one; PPOConfig's are "PPO")
GROUPS = {
    "data": ("data", "rollout_split", "qc_split", "dev_split", "qc_data", "dev_data", "augment", "cutmix_prob",
             "rollout_with_checks", "rollout_data", "data_workers"),
    "model": ("model", "weights", "pretrained", "random_backbone", "img_size", "num_classes", "readout", "device",
              "actor_width", "budget_step", "init_actor", "skip_dead", "merge"),
    "recipe and rewards": ("recipe", "target_drop", "a_init", "fixed_coefficient", "terminal_only", "tau_b"),
    "feedback (App. C)": ("feedback_cadence", "qc_shards", "qc_with_rollout", "qc_with_dev", "feedback_ema",
                          "feedback_signal", "target_disagreement"),
    "selection": ("selection", "checkpoint_every"),
    "speed": ("batch_scale", "shadow_chunk", "eval_batch", "cuda_graphs", "overlap", "compile", "critic_bf16"),
    "output": ("out", "resume", "max_minutes", "tensorboard", "progress"),
}
# settings --resume may change (how long, how fast, what is shown; not what is trained)
RESUMABLE = ("max_minutes", "updates", "tensorboard", "progress", "data_workers", "shadow_chunk", "device", "data",
             "qc_data", "dev_data")  # (--updates: the run continued for longer; the data paths: the same images, moved)


def field_help(cls: type) -> Dict[str, str]:
    """Each field's help line: its trailing comment in ``cls``'s source (every setting is
    described once, where it is defined)."""
    src = inspect.getsource(cls)
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^    (\w+): [^\n]*?#\s*(.+)$", src, re.M)}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" for flags without a default
        return action.help if action.default in (None, argparse.SUPPRESS) or action.required else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="timm-dora-train",
        description="Train a DORA actor for a timm ViT with the paper's PPO recipe (torchrun for several GPUs).",
        formatter_class=_Help,
    )
    ap.add_argument("--version", action="version", version=f"timm-dora-train {__version__}")
    helps = {**field_help(TrainConfig), **{f"ppo__{k}": v for k, v in field_help(PPOConfig).items()}}
    helps["resume"] = "continue the run in --out from its state.pt, exactly (the same settings; see RESUMABLE)"
    groups = {name: ap.add_argument_group(name) for name in GROUPS}
    where = {f: groups[name] for name, fields in GROUPS.items() for f in fields}
    where["resume"].add_argument("--resume", action="store_true", help=helps["resume"])
    for f in dataclasses.fields(TrainConfig):
        if f.name == "ppo":
            continue
        if f.name == "augment":
            where[f.name].add_argument("--augment", nargs="?", const="light", default="none", choices=AUGMENT_LEVELS,
                                       help="rollout augmentation for small pools (ours): light = crop (0.5-1) + flip; strong "
                                            "= crop (0.25-1) + flip + RandAugment + label-free patch CutMix (--cutmix-prob); "
                                            "bare --augment = light")
            continue
        _add(where[f.name], f.name, f.type, f.default, helps[f.name], required=f.name in ("model", "data", "out"))
    ppo = ap.add_argument_group("PPO (App. D)")
    for f in dataclasses.fields(PPOConfig):
        if f.name != "total_images":  # = rollout_images * updates
            _add(ppo, f.name, f.type, f.default, helps[f"ppo__{f.name}"], prefix="ppo")
    return ap


def _add(ap, name, typ, default, help, prefix=None, required=False):
    flag = "--" + name.replace("_", "-")
    dest = f"{prefix}__{name}" if prefix else name
    typ = str(typ)
    kw = dict(dest=dest, default=default, help=help)
    if required:
        kw.update(required=True, default=None)
    if "bool" in typ:
        ap.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    else:
        kind = int if "int" in typ else float if "float" in typ else str
        ap.add_argument(flag, type=kind, metavar={int: "N", float: "X"}.get(kind, name.split("_")[-1].upper()), **kw)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    ppo_kw = {k.split("__", 1)[1]: v for k, v in vars(args).items() if k.startswith("ppo__")}
    top = {k: v for k, v in vars(args).items() if not k.startswith("ppo__") and k != "resume"}
    ppo_kw["total_images"] = ppo_kw["rollout_images"] * ppo_kw["updates"]
    return TrainConfig(ppo=PPOConfig(**ppo_kw), **top)
