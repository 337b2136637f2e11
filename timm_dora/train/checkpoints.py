"""Checkpoints of a training run (:class:`CheckpointLog`, held by :class:`~timm_dora.train.loop.Trainer`):
the saved actors, the full training state for an exact ``--resume``, and the dev selection rule
that writes ``OUT/selected`` (App. E.2); and how a run's actor starts (its width, a warm start)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from ..policy import Actor, auto_width
from .selection import CheckpointRecord, select_checkpoint

__all__ = ["CheckpointLog", "actor_width", "warm_start"]


class CheckpointLog:
    """A run's checkpoints on disk: each one's actor (``OUT/checkpoints/uNNNNN``, with its dev
    record and training facts), the full training state of the last one (``OUT/state.pt``, for an
    exact ``--resume``), and the dev selection rule that writes ``OUT/selected`` (App. E.2). Only
    the first process writes; every process keeps the records."""

    def __init__(self, out: Path, main: bool) -> None:
        self.out, self.main = out, main
        self.records: List[Dict] = []  # each checkpoint's CheckpointRecord, as a dict

    def save(self, rec: CheckpointRecord, actor: Actor, model: nn.Module, facts: Dict,
             state: Callable[[], Dict]) -> None:
        """Save the actor of checkpoint ``rec`` and, after recording it, the training state
        (``state()``, which includes :attr:`records`)."""
        if self.main:
            actor.save_pretrained(self.out / "checkpoints" / rec.name, backbone=model, extra=facts)
        self.records.append(dataclasses.asdict(rec))
        if self.main:
            torch.save(state(), self.out / "state.pt")

    def select(self, target_drop: float, rule: str, model: nn.Module) -> Dict:
        """Apply the dev selection rule and write the chosen actor to ``OUT/selected``."""
        recs = [CheckpointRecord(**r) for r in self.records]
        choice = select_checkpoint(recs, target_pp=100.0 * target_drop, rule=rule)
        actor = Actor.from_pretrained(self.out / "checkpoints" / choice.record.name)
        summary = {"selected": dataclasses.asdict(choice.record), "violates": choice.violates,
                   "target_pp": 100.0 * target_drop, "rule": rule, "checkpoints": self.records}
        if rule == "fit":
            summary["fitted_drops"] = list(choice.drops)
        actor.save_pretrained(self.out / "selected", backbone=model,
                              extra={**actor.pretrained_config.get("training", {}), "selection": summary})
        (self.out / "selection.json").write_text(json.dumps(summary, indent=1))
        return summary


def actor_width(given: Optional[int], init_actor: Optional[str], model: nn.Module) -> int:
    """The encoder width of a run's actor: ``--actor-width`` when given, else the warm start's
    (``--init-actor``), else :func:`~timm_dora.policy.auto_width` of the backbone."""
    if given:
        return given
    if init_actor:
        from ..hub import load_actor

        return load_actor(init_actor)[0].width
    return auto_width(model)


def warm_start(source: str, actor: Actor, model: nn.Module, readout: str) -> Dict:
    """Load the saved actor at ``source`` (``--init-actor``) into ``actor``, checked against the
    backbone and against ``actor`` (same sizes), or a ``ValueError``. Returns the saved actor's own
    training record (``{}`` if none), which the run's checkpoints carry as ``init_training``."""
    from ..hub import check_backbone, load_actor

    loaded, config = load_actor(source)
    check_backbone(config, model, readout)
    def sizes(a: Actor) -> Dict:  # merging is the engine's treatment of the removals, not a size:
        return {k: v for k, v in a.config().items() if k != "merge"}  # a deleting actor may start a merging run

    if sizes(loaded) != sizes(actor):
        here = actor.config()
        diff = {k: (v, here.get(k)) for k, v in sizes(loaded).items() if here.get(k) != v}
        raise ValueError(f"--init-actor {source}: its sizes differ from this run's actor (saved, here): {diff}")
    actor.load_state_dict(loaded.state_dict())
    return dict(config.get("training") or {})
