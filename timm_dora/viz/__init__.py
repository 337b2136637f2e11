"""Pictures of DORA: per-image pruning trajectories, policy statistics, training dynamics, trade-offs.

Numbers and drawing are kept apart. The ``*_data`` functions turn the existing outputs
(:class:`~timm_dora.engine.patch.DoraStats`, ``metrics.jsonl`` rows of :mod:`timm_dora.train`, eval/bench
JSON) into plain dicts of Python numbers and numpy arrays, reading every number from those outputs
(kept tokens from ``stats.tokens``, budgets from ``stats.removed``, GFLOPs from ``stats.gflops``,
``a_u``/``d_u`` from the log) and never recomputing them another way. The ``plot_*`` functions
draw such a dict and return a matplotlib ``Figure``; :func:`save` writes it as PNG and/or SVG.

    stats = model.dora_stats                                       # after a wrapped forward
    data = trajectory_data(stats, 0, model=model, image=images[0])
    save(plot_trajectory(data), "out/trajectory")                  # out/trajectory.png, .svg

    fig, datas = trajectory_grid(model, images)                    # runs the wrapped model
    plot_policy(policy_data(list_of_stats, native_gflops(model)))
    plot_training(training_data(read_metrics("runs/x/metrics.jsonl")))
    plot_tradeoff(tradeoff_data(read_results(["eval.json", "bench.json"])))
    plot_sweep([sweep_data(json.load(open("tradeoff_vit_tiny.json")))])   # benchmarks/tradeoff.py
    plot_comparison([comparison_data(json.load(open("baselines_vit_tiny.json")))])  # benchmarks/baselines.py

Artists carrying plotted values have a ``gid`` (``"trajectory-0-3"``, ``"a_u"``, ``"drop_mean"``,
...), so ``fig.findobj(lambda a: a.get_gid() == "a_u")`` finds them. Blocks are numbered from 0,
as in ``DoraStats`` and the paper. matplotlib (the ``viz`` extra) is imported only inside the
drawing functions; figures are built with ``matplotlib.figure.Figure`` (no pyplot, no GUI backend).

The ``timm-dora viz`` command (:mod:`~timm_dora.viz.cli`): ``trajectory``, ``policy``, ``training``
and ``tradeoff`` pictures, each written with its numbers as JSON next to it.
"""
from .data import (comparison_data, concat_stats, grey_patches, is_comparison, is_sweep, patch_geometry, policy_data, read_metrics, read_results,
                   sweep_data, to_uint8_image, tradeoff_data, training_data, trajectory_data)
from .plots import (collect_stats, plot_comparison, plot_policy, plot_sweep, plot_tradeoff, plot_training, plot_trajectory, plot_trajectory_grid, save,
                    trajectory, trajectory_grid)

__all__ = ["collect_stats", "comparison_data", "concat_stats", "grey_patches", "is_comparison", "is_sweep", "patch_geometry", "plot_comparison",
           "plot_policy", "plot_sweep", "plot_tradeoff",
           "plot_training", "plot_trajectory", "plot_trajectory_grid", "policy_data", "read_metrics", "read_results",
           "save", "sweep_data", "to_uint8_image", "tradeoff_data", "training_data", "trajectory", "trajectory_grid",
           "trajectory_data"]
