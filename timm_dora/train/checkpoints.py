"""Checkpoints of a training run (mixed into :class:`~timm_dora.train.loop.Trainer`): the dev
evaluation of each checkpoint, the full training state for an exact ``--resume``, and the dev
selection rule that writes ``OUT/selected`` (App. E.2)."""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Dict, Optional

import torch
import torch.nn as nn

from ..policy import Actor, ActorPolicy, auto_width
from .selection import CheckpointRecord, select_checkpoint

__all__ = ["Checkpoints", "warm_start"]


class Checkpoints:
    """Saving, resuming and selecting (every attribute it reads is the trainer's)."""

    def evaluate_dev(self) -> CheckpointRecord:
        """The actor on the dev split: each process its share, the counts summed (every process
        calls it)."""
        dev = self.images.dev
        pred, gflops = self._predict(dev, ActorPolicy(self.actor))
        sums = self.comm.sum_(torch.stack([(pred == dev.labels).sum().double(), gflops.double().sum(),
                                           (pred != self.dev_native_pred).sum().double()]).cpu())
        top1, mean_gflops, disagreement = (float(v) / self.dev_size for v in sums)
        return CheckpointRecord(f"u{self.u:05d}", 100.0 * top1, self.dev_native_top1, mean_gflops, 100.0 * disagreement)

    def state_dict(self) -> Dict:
        self._finish_critic()  # (overlap: the critic's last steps may still be running)
        return {
            "u": self.u,
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "opts": {k: o.state_dict() for k, o in self.opts.items()},
            "rms": self.rms.state_dict(),
            "feedback": self.feedback.state_dict(),
            "sampler": self.sampler.state_dict(),
            "gen": self.gen.get_state(),
            "cpu_gen": self.cpu_gen.get_state(),
            "checkpoints": self.checkpoints,
            "config": dataclasses.asdict(self.cfg),
            "cpu_threads": torch.get_num_threads(),
        }

    def load_state_dict(self, state: Dict) -> None:
        self.stop_prefetch()  # its batches follow the sampler state being replaced
        self.u = int(state["u"])
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        for k, o in self.opts.items():
            o.load_state_dict(state["opts"][k])
        self.rms.load_state_dict(state["rms"])
        self.feedback.load_state_dict(state["feedback"])
        self.sampler.load_state_dict(state["sampler"])
        self.gen.set_state(state["gen"])
        self.cpu_gen.set_state(state["cpu_gen"])
        self.checkpoints = list(state["checkpoints"])
        threads = state.get("cpu_threads")
        if self.dev.type == "cpu" and threads and threads != torch.get_num_threads():
            # CPU float reductions split their work by thread count: the same count continues exactly
            print(f"--resume: using {threads} CPU threads, as the saved run did (this process had "
                  f"{torch.get_num_threads()})", file=sys.stderr)
            torch.set_num_threads(threads)

    def save_checkpoint(self) -> CheckpointRecord:
        """Evaluate on dev (every process its share) and save actor + training state (first process)."""
        rec = self.evaluate_dev()
        if self.comm.main:
            folder = self.out / "checkpoints" / rec.name
            self.actor.save_pretrained(folder, backbone=self.model, extra=self._training_facts(rec))
        self.checkpoints.append(dataclasses.asdict(rec))
        if self.comm.main:
            torch.save(self.state_dict(), self.out / "state.pt")
        self.comm.barrier()
        return rec

    def _training_facts(self, rec: CheckpointRecord) -> Dict:
        return {
            "updates": self.u, "target_drop": self.cfg.target_drop, "a_u": self.feedback.coefficient,
            "dev_top1": rec.top1, "dev_native_top1": rec.native_top1, "dev_gflops": rec.gflops,
            "model": self.cfg.model, "data": self.cfg.data, **({"skip_dead": True} if self.cfg.skip_dead else {}),
            **({"init_actor": self.cfg.init_actor, "init_training": self.init_training} if self.cfg.init_actor else {}),
        }

    def select(self) -> Dict:
        """Apply the dev selection rule and write the chosen actor to ``OUT/selected``."""
        recs = [CheckpointRecord(**r) for r in self.checkpoints]
        choice = select_checkpoint(recs, target_pp=100.0 * self.cfg.target_drop, rule=self.cfg.selection)
        actor = Actor.from_pretrained(self.out / "checkpoints" / choice.record.name)
        summary = {"selected": dataclasses.asdict(choice.record), "violates": choice.violates,
                   "target_pp": 100.0 * self.cfg.target_drop, "rule": self.cfg.selection, "checkpoints": self.checkpoints}
        if self.cfg.selection == "fit":
            summary["fitted_drops"] = list(choice.drops)
        actor.save_pretrained(self.out / "selected", backbone=self.model,
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
