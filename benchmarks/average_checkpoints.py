"""Average the weights of several saved actors of one training run (ours; ``docs/training_rounds.md``,
checkpoint averaging).

    python -m benchmarks.average_checkpoints --out runs/b8_averaged runs/b8/checkpoints/u00{6,7,8,9}00 \\
        runs/b8/checkpoints/u01{0,1}00 runs/b8/checkpoints/u01171
    timm-dora distill ... --teacher runs/b8_averaged --width 32 --seed 0 --out student

Every actor must have the same configuration (constructor arguments, backbone, budget grid): a
one-line error names the first that differs. The result is the element-wise mean of their weights
(summed in float64, stored in the weights' dtype), saved in the hub format with the last actor's
training record and ``weight_average_of`` (the folders, in the order given). As stochastic weight
averaging does for supervised nets, it asks whether the mean of one run's late policies generalises
better than any one of them; on DeiT-Ti it did not (``benchmarks/results/tradeoff_deit_tiny_averaged.json``).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence

import torch

from timm_dora.hub import load_pretrained, save_pretrained

SAME = ("actor", "backbone", "budget_grid")  # the config sections every averaged actor must share


def average(folders: Sequence[str], out: str) -> Dict[str, Any]:
    """Save the mean of the actors in ``folders`` to ``out``; returns the saved config's training record."""
    if len(folders) < 2:
        raise ValueError(f"average_checkpoints: need at least two actors, got {len(folders)}")
    loaded = [load_pretrained(f) for f in folders]
    first = loaded[0][1]
    for folder, (_, cfg) in zip(folders[1:], loaded[1:]):
        for key in SAME:
            if cfg.get(key) != first.get(key):
                raise ValueError(f"average_checkpoints: {folder} differs from {folders[0]} in its {key!r} configuration")
    states: List[Dict[str, torch.Tensor]] = [a.state_dict() for a, _ in loaded]
    actor, config = loaded[-1]
    mean = {k: (sum(s[k].double() for s in states) / len(states)).to(v.dtype) for k, v in states[-1].items()}
    actor.load_state_dict(mean)
    training = {**(config.get("training") or {}), "weight_average_of": list(folders)}
    save_pretrained(actor, out, backbone=config.get("backbone"), extra=training)
    return training


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("actors", nargs="+", help="actor folders (hub format) of one run, e.g. its checkpoints")
    ap.add_argument("--out", required=True, help="the averaged actor's folder")
    args = ap.parse_args(argv)
    return average(args.actors, args.out)


if __name__ == "__main__":
    main()
