"""End to end: the timm-dora-train CLI on a tiny random ViT and generated images (CPU)."""
import collections
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from timm_dora import Actor
from timm_dora.train import main

ARGS = [
    "--model", "vit_tiny_patch16_224", "--img-size", "64", "--num-classes", "4", "--device", "cpu", "--random-backbone",
    "--updates", "4", "--rollout-images", "6", "--checkpoint-every", "2", "--feedback-cadence", "2",
    "--qc-shards", "2", "--gate-minibatch", "16", "--controller-minibatch", "4", "--critic-minibatch", "16",
    "--actor-epochs", "2", "--critic-epochs", "2", "--no-progress", "--a-init", "5", "--recipe", "paper",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i, split in enumerate(["rollout"] * 10 + ["qc"] * 4 + ["dev"] * 4):
        arr = (torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).save(root / f"{i}.png")
        rows.append(f"{i}.png,{i % 4},n{i % 4:08d},x,{split}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


@pytest.fixture
def one_thread():
    """CPU float reductions are bit-reproducible run to run only single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_logs_checkpoints_and_resumes_exactly(data, tmp_path, one_thread):
    full = tmp_path / "full"
    assert main(ARGS + ["--data", str(data), "--out", str(full)]) == 0
    m = read_metrics(full)
    assert [r["update"] for r in m] == [1, 2, 3, 4]
    for key in ("a_u", "return_mean", "compression", "gflops", "entropy_gate", "loss_value", "rollout_images_per_s"):
        assert all(key in r for r in m), key
    assert "d_u" in m[1] and "d_u" not in m[0]  # feedback every 2 updates, after the rollout
    core = {"data", "native", "rollout", "shadows", "old_values", "actor_update", "critic_update", "metrics"}
    assert set(m[0]["phases"]) == core and set(m[1]["phases"]) == core | {"feedback", "checkpoint"}
    assert all(v >= 0 for r in m for v in r["phases"].values())
    assert sum(m[0]["phases"].values()) <= m[0]["update_s"] * 1.01 + 0.01  # the phases split the update
    assert m[2]["a_u"] == m[1]["a_next"]  # a_{u+1} applies from the next rollout on
    sel = json.loads((full / "selection.json").read_text())
    assert {c["name"] for c in sel["checkpoints"]} == {"u00002", "u00004"}
    actor = Actor.from_pretrained(full / "selected")
    assert actor.num_patches == 16 and actor.depth == 12

    # interrupted after the checkpoint at u=2 (a crash leaves the state at that checkpoint), resumed
    part = tmp_path / "part"
    assert main(ARGS + ["--data", str(data), "--out", str(part), "--updates", "2"]) == 0
    assert main(ARGS + ["--data", str(data), "--out", str(part), "--resume"]) == 0
    assert _without_timings(read_metrics(part)) == _without_timings(m)
    a = Actor.from_pretrained(full / "checkpoints" / "u00004").state_dict()
    b = Actor.from_pretrained(part / "checkpoints" / "u00004").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_batch_scale_trains_the_larger_batch_and_resumes(data, tmp_path, one_thread):
    """``--batch-scale 2`` (each of 2 GPUs the paper's batch) is the run with twice the rollout images
    and minibatches, drawn from 2 strata, and half the updates, feedback checks and checkpoints, given by hand: the same
    config.json (but the flag), metrics and actor, also when stopped at its first checkpoint and
    resumed with the same flags. (The scaled settings once reached the config but not the rollout's
    local batch: half of each batch was rolled out, and every per-image metric read half.)"""
    sized = {"--updates", "--rollout-images", "--checkpoint-every", "--feedback-cadence", "--gate-minibatch",
             "--controller-minibatch", "--critic-minibatch"}
    base = [a for i, a in enumerate(ARGS) if a not in sized and ARGS[i - 1] not in sized]
    assert len(base) == len(ARGS) - 14
    scaled = base + ["--updates", "4", "--rollout-images", "3", "--checkpoint-every", "2", "--feedback-cadence", "2",
                     "--gate-minibatch", "8", "--controller-minibatch", "2", "--critic-minibatch", "8", "--batch-scale", "2"]
    by_hand = base + ["--updates", "2", "--rollout-images", "6", "--checkpoint-every", "1", "--feedback-cadence", "1",
                      "--gate-minibatch", "16", "--controller-minibatch", "4", "--critic-minibatch", "16", "--strata", "2"]
    runs = {}
    for name, args in (("scaled", scaled), ("by_hand", by_hand)):
        runs[name] = tmp_path / name
        assert main(args + ["--data", str(data), "--out", str(runs[name])]) == 0
    cfg = {k: json.loads((runs[k] / "config.json").read_text()) for k in runs}
    assert cfg["scaled"].pop("batch_scale") == 2 and cfg["by_hand"].pop("batch_scale") == 1
    assert {k: v for k, v in cfg["scaled"].items() if k != "out"} == {k: v for k, v in cfg["by_hand"].items() if k != "out"}
    m = _without_timings(read_metrics(runs["by_hand"]))
    assert _without_timings(read_metrics(runs["scaled"])) == m and [r["update"] for r in m] == [1, 2]
    assert all("d_u" in r for r in m)  # a check at every update, as every 2 at the paper's batch
    a, b = _actor(runs["scaled"], "u00002"), _actor(runs["by_hand"], "u00002")
    assert all(torch.equal(a[k], b[k]) for k in a)
    part = tmp_path / "part"
    assert main(scaled + ["--data", str(data), "--out", str(part), "--max-minutes", "1e-9"]) == 0  # stops after u=1
    assert [r["update"] for r in read_metrics(part)] == [1]
    assert main(scaled + ["--data", str(data), "--out", str(part), "--resume"]) == 0
    assert _without_timings(read_metrics(part)) == m


def test_cli_runs_are_bitwise_reproducible_across_processes(data, tmp_path):
    """Two fresh processes, two CPU threads each (torch's CPU index_put accumulates with atomics on
    several threads unless the run selects deterministic algorithms, as the CLI does on the CPU)."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "timm_dora.train", *ARGS, "--updates", "2", "--data", str(data), "--out", str(out)]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        runs.append((Actor.from_pretrained(out / "checkpoints" / "u00002").state_dict(), read_metrics(out)))
    (a, ma), (b, mb) = runs
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _without_timings(ma) == _without_timings(mb)
    assert not torch.are_deterministic_algorithms_enabled()  # in-process runs leave the setting as it was


def _without_timings(rows):
    return [{k: v for k, v in r.items() if k not in ("rollout_images_per_s", "update_s", "phases", "time")} for r in rows]


def test_cli_refuses_overlapping_splits_and_existing_runs(data, tmp_path, capsys):
    bad = data.parent / "overlap.csv"
    lines = data.read_text().splitlines()
    bad.write_text("\n".join(lines + [lines[1].replace(",rollout", ",dev")]) + "\n")
    assert main(ARGS + ["--data", str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("timm-dora-train: error: ") and "overlap" in err and err.count("\n") == 1
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--updates", "2"]) == 0
    assert main(ARGS + ["--data", str(data), "--out", str(out)]) == 2


class _HostReads(TorchDispatchMode):
    """Counts the operations of a PPO update that make the host wait for an accelerator: scalar
    reads, ``nonzero``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``, and
    (patched in the test) ``tolist`` / ``cpu``. On the CPU they run alike, so counting them there
    shows what a CUDA update would wait on. Adam's steps are skipped: its step counters live on the
    host unless it is ``capturable`` or ``fused``."""

    OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default)
    INDEX = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)

    def __init__(self):
        super().__init__()
        self.counts, self.steps, self.in_step = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_step and (
            func in self.OPS
            or (func in self.INDEX and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))
            or (func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)
        ):
            self.counts[str(func)] += 1
        return func(*args, **kwargs)


def test_ppo_update_host_reads_do_not_grow_with_minibatches(data, tmp_path, monkeypatch, one_thread):
    """One PPO update waits for the device a fixed number of times, however many minibatches it has."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from timm_dora.train.ppo import PPOConfig
    from timm_dora.train import TrainConfig, Trainer

    reads = _HostReads()

    def counted(name):
        method = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            reads.counts[name] += 1
            return method(self, *args, **kwargs)
        return wrapper

    def counting(update):
        def wrapper(self, *args):
            with monkeypatch.context() as m, reads:
                for name in ("tolist", "cpu"):
                    m.setattr(torch.Tensor, name, counted(name))
                return update(self, *args)
        return wrapper

    monkeypatch.setattr(Trainer, "_ppo_update", counting(Trainer._ppo_update))
    pre = register_optimizer_step_pre_hook(lambda opt, *a: setattr(reads, "in_step", True))
    post = register_optimizer_step_post_hook(lambda opt, *a: (setattr(reads, "in_step", False), reads.steps.update([opt])))
    results = []
    try:
        for gate, ctrl, critic in ((16, 4, 16), (5, 2, 7)):
            ppo = PPOConfig(updates=1, total_images=6, rollout_images=6, gate_minibatch=gate, controller_minibatch=ctrl,
                            critic_minibatch=critic, actor_epochs=2, critic_epochs=2)
            trainer = Trainer(TrainConfig(model="vit_tiny_patch16_224", data=str(data), out=str(tmp_path / str(gate)), img_size=64,
                                          num_classes=4, device="cpu", random_backbone=True, qc_shards=2, progress=False, a_init=5.0, ppo=ppo))
            reads.counts.clear()
            reads.steps.clear()
            trainer.step()
            results.append((dict(reads.counts), {k: reads.steps[o] for k, o in trainer.opts.items()}))
    finally:
        pre.remove()
        post.remove()
    (reads_a, steps_a), (reads_b, steps_b) = results
    assert all(steps_a[k] < steps_b[k] for k in ("gate", "shared", "critic")), (steps_a, steps_b)
    assert reads_a == reads_b and sum(reads_a.values()) <= 32, (reads_a, reads_b)


def test_warm_start_from_a_saved_actor(data, tmp_path):
    """``--init-actor``: the run starts from the saved actor's weights; a saved actor for another
    backbone, or with other sizes, is refused with the field named."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    def trainer(*extra):
        return Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path / "run")] + list(extra))))

    fresh = trainer().actor
    saved = Actor(fresh.embed_dim, fresh.depth, fresh.num_patches)
    with torch.no_grad():
        for t in saved.parameters():
            t.normal_()
    saved.save_pretrained(tmp_path / "saved")
    warm = trainer("--init-actor", str(tmp_path / "saved")).actor.state_dict()
    assert all(torch.equal(warm[k], v) for k, v in saved.state_dict().items())
    assert not torch.equal(warm["gate_embed"], fresh.state_dict()["gate_embed"])

    Actor(fresh.embed_dim, fresh.depth, 9).save_pretrained(tmp_path / "other_backbone")
    with pytest.raises(ValueError, match="num_patches"):
        trainer("--init-actor", str(tmp_path / "other_backbone"))
    Actor(fresh.embed_dim, fresh.depth, fresh.num_patches, gate_hidden=32).save_pretrained(tmp_path / "other_sizes")
    with pytest.raises(ValueError, match="gate_hidden"):
        trainer("--init-actor", str(tmp_path / "other_sizes"))


@pytest.mark.parametrize("level", ["light", "strong"])
def test_augmented_rollout_images_depend_only_on_seed_update_and_image(data, tmp_path, level):
    """Every RNG the transforms draw from (``random`` for timm's crop and RandAugment, ``numpy``,
    ``torch`` for the flip and the CutMix) is seeded per (seed, update, image): the same images
    whatever the global RNG state and whatever else is in the batch (resume, any world size)."""
    import random

    import numpy as np

    from timm_dora.train import Trainer, build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path), "--augment", level]))
    assert cfg.augment == level
    tr = Trainer(cfg)
    assert tr.images.rollout_mode == "stream"
    idx = torch.arange(10)
    x = tr.images.made_here(3, idx)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    assert torch.equal(tr.images.made_here(3, idx), x)
    assert torch.equal(tr.images.made_here(3, idx[[7, 2]]), x[[7, 2]])
    assert not torch.equal(tr.images.made_here(4, idx), x)


def test_rollout_batches_made_ahead_in_workers_equal_the_in_process_ones(data, tmp_path, one_thread, monkeypatch):
    """``--data-workers`` makes the augmented rollout batches ahead, in worker processes, while the
    update runs: the run equals the in-process one bit for bit, and a resumed run (whose workers
    start again from the restored sampler) equals both."""
    from timm_dora.train import pool as P

    served = []
    original = P.RolloutStream.__next__
    monkeypatch.setattr(P.RolloutStream, "__next__", lambda self: served.append(self.loader.num_workers) or original(self))
    runs = {}
    for workers in ("0", "2"):
        out = tmp_path / workers
        assert main(ARGS + ["--data", str(data), "--out", str(out), "--augment", "strong", "--data-workers", workers]) == 0
        runs[workers] = _without_timings(read_metrics(out))
    assert runs["2"] == runs["0"] and len(runs["0"]) == 4
    assert served == [0] * 4 + [2] * 4  # made in this process, then by the workers
    part = tmp_path / "part"
    args = ARGS + ["--data", str(data), "--out", str(part), "--augment", "strong", "--data-workers", "2"]
    assert main(args + ["--updates", "2"]) == 0
    assert main(args + ["--resume"]) == 0
    assert _without_timings(read_metrics(part)) == runs["0"]


def _actor(out, name):
    return Actor.from_pretrained(out / "checkpoints" / name).state_dict()


def test_streamed_rollouts_train_as_held_ones_and_resume_mid_pass(data, tmp_path, one_thread):
    """The rollout images read from the files by worker processes for every update (``stream``,
    how a large split runs) train exactly as the same images decoded once and held (``held``, the
    default for this 10-image pool): equal metrics and actor weights. A streamed run stopped at
    u=2 (12 of the pass's images drawn: the second pass under way) and resumed equals both."""
    runs = {}
    for mode, workers in (("held", "0"), ("stream", "2")):
        out = tmp_path / mode
        assert main(ARGS + ["--data", str(data), "--out", str(out), "--rollout-data", mode, "--data-workers", workers]) == 0
        runs[mode] = out
    held, stream = (_without_timings(read_metrics(runs[m])) for m in ("held", "stream"))
    assert stream == held and len(held) == 4 and held[-1]["skipped_images"] == 0
    a, b = _actor(runs["held"], "u00004"), _actor(runs["stream"], "u00004")
    assert all(torch.equal(a[k], b[k]) for k in a)
    part = tmp_path / "part"
    args = ARGS + ["--data", str(data), "--out", str(part), "--rollout-data", "stream", "--data-workers", "2"]
    assert main(args + ["--updates", "2"]) == 0
    state = torch.load(part / "state.pt", weights_only=True)["sampler"]
    assert (state["epoch"], state["position"]) == (2, 2)  # mid-pass
    assert main(args + ["--resume"]) == 0
    assert _without_timings(read_metrics(part)) == held
    c = _actor(part, "u00004")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_unreadable_images_are_skipped_named_and_counted(data, tmp_path, capsys):
    """A corrupt rollout file is replaced by the next readable image and a corrupt qc file left out
    of the checks, each named in one warning; ``skipped_images`` counts them; the run completes."""
    import shutil

    root = tmp_path / "d"
    shutil.copytree(data.parent, root)
    (root / "3.png").write_bytes(b"\x89PNG broken")  # a rollout image
    (root / "11.png").write_bytes(b"")  # a qc image
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(root / "labels.csv"), "--out", str(out), "--rollout-data", "stream",
                        "--data-workers", "0"]) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "skipped unreadable image" in ln]
    assert len(warned) == 2 and any("11.png" in ln for ln in warned) and any("3.png" in ln for ln in warned)
    # the qc file once, at the start; the rollout file each time the sampler draws image 3
    from timm_dora.train.pool import RolloutSampler

    sampler = RolloutSampler(10, 6, torch.Generator().manual_seed(42))
    drawn = [next(sampler).count(3) for _ in range(4)]
    expected = [1 + sum(drawn[: u + 1]) for u in range(4)]
    assert [r["skipped_images"] for r in read_metrics(out)] == expected and expected[-1] >= 3
    # the held path reads the same images: the corrupt rollout file's rows are its successor's
    from timm_dora.train import Trainer, build_parser, config_from_args

    tr = Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(root / "labels.csv"), "--out",
                                                                    str(tmp_path / "t")])))
    assert tr.images.rollout_mode == "held" and tr.images.held_rollout.index == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert torch.equal(tr.images.rollout(1, list(range(10)), [3]), tr.images.made_here(1, [4]))
    assert len(tr.images.checks) == 3 and tr.check_sizes == [1, 2]


def test_bad_splits_are_one_line_errors_before_the_model_moves(data, tmp_path, capsys, monkeypatch):
    """A label outside the model's classes, an empty or unknown split and overlapping splits stop
    the run in one line before the backbone is wrapped and moved to the device."""
    from timm_dora.train import loop

    monkeypatch.setattr(loop, "wrap", lambda *a, **k: pytest.fail("the model moved before the data was checked"))
    lines = data.read_text().splitlines()
    cases = {
        "label": ([lines[0]] + [ln.replace(",1,n00000001,", ",7,n00000001,") for ln in lines[1:]],
                  "split 'rollout': label 7 of .*1.png is outside the model's 4 classes"),
        "empty": ([ln for ln in lines if not ln.endswith(",dev")], "unknown split 'dev'"),
        "overlap": (lines + [lines[1].replace(",rollout", ",dev")], "splits 'rollout' and 'dev' overlap"),
    }
    for name, (rows, message) in cases.items():
        bad = data.parent / f"bad_{name}.csv"
        bad.write_text("\n".join(rows) + "\n")
        assert main(ARGS + ["--data", str(bad), "--out", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("timm-dora-train: error: "), err
        import re

        assert re.search(message, err), (name, err)
    empty = tmp_path / "empty_folder" / "dev"
    empty.mkdir(parents=True)
    assert main(ARGS + ["--data", str(data), "--dev-data", str(empty), "--out", str(tmp_path / "e")]) == 1
    assert "no images found under" in capsys.readouterr().err


def test_strong_augmentation_pastes_patch_aligned_rectangles(data, tmp_path):
    """``--augment strong``: with ``--cutmix-prob 1`` each image is its ``--cutmix-prob 0`` self
    with one rectangle of whole 16 x 16 tiles replaced (the other image's tokens); bare
    ``--augment`` means ``light``."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    def images(*extra):
        args = ARGS + ["--data", str(data), "--out", str(tmp_path)] + list(extra)
        tr = Trainer(config_from_args(build_parser().parse_args(args)))
        return tr.images.made_here(2, torch.arange(10))

    assert config_from_args(build_parser().parse_args(ARGS + ["--data", "d", "--out", "o", "--augment"])).augment == "light"
    plain, mixed = images("--augment", "strong", "--cutmix-prob", "0"), images("--augment", "strong", "--cutmix-prob", "1")
    changed = (plain != mixed).any(1)  # [10, 64, 64]
    tiles = changed.view(10, 4, 16, 4, 16).any(4).any(2)  # [10, 4, 4] tiles touched
    assert tiles.any()
    for t, c in zip(tiles, changed):
        if t.any():
            rows, cols = t.any(1).nonzero().flatten(), t.any(0).nonzero().flatten()
            assert t.sum() == len(rows) * len(cols)  # one rectangle
            assert rows.diff().eq(1).all() and cols.diff().eq(1).all()
        # whole tiles: every pixel of a touched tile may differ, none outside
        assert not c[~t.repeat_interleave(16, 0).repeat_interleave(16, 1)].any()
    with pytest.raises(ValueError, match="cutmix-prob"):
        images("--augment", "strong", "--cutmix-prob", "1.5")


def test_budget_step_sets_the_grid_of_actor_critic_and_rollouts(data, tmp_path):
    """``--budget-step 4``: the budget grid {4, 8, 12} (N0 = 16) for the actor, the critic's budget
    embedding and every removal in the rollouts; the saved actor keeps it; a warm start from an
    actor with the paper's grid is refused with the field named; a step of 0 is refused."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    def trainer(*extra):
        return Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path / "run")] + list(extra))))

    tr = trainer("--budget-step", "4")
    assert tr.actor.budgets.tolist() == [4, 8, 12] and tr.actor.budget_step == 4
    assert tr.critic.num_budgets == 3
    from timm_dora.engine.patch import run
    from timm_dora.policy import NoPrune, RolloutNoise
    from timm_dora.train.rollout import collect

    x = tr.images.made_here(1, torch.arange(6))
    noise = RolloutNoise.draw(tr.depth, 6, tr.actor.num_budgets, tr.num_patches, tr.gen, tr.dev)
    with torch.no_grad():
        traj = collect(tr.model, tr.actor, x, z_native=run(tr.model, x, NoPrune())[0].float(), noise=noise)
    assert (traj.k > 0).any() and (traj.k % 4 == 0).all()
    tr.step()  # an update with the 3-budget critic and actor
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "cli"), "--budget-step", "4", "--updates", "2"]) == 0
    saved = Actor.from_pretrained(tmp_path / "cli" / "selected")
    assert saved.budgets.tolist() == [4, 8, 12]
    paper = Actor.for_model(tr.model)  # budget step 2
    paper.save_pretrained(tmp_path / "paper_grid")
    with pytest.raises(ValueError, match="budget_step"):
        trainer("--budget-step", "4", "--init-actor", str(tmp_path / "paper_grid"))
    with pytest.raises(ValueError, match="--budget-step must be at least 1, got 0"):
        trainer("--budget-step", "0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_ppo_steps_equal_eager_steps(data, tmp_path):
    """The gate, controller and critic steps replayed from CUDA graphs train as the eager ones do
    (float rounding: capturable Adam and the replayed kernels may round differently), and with the
    critic's steps left running beside the next rollout (``--overlap``, the default) as without:
    the same steps, and each update's critic loss in its own record. The same tolerance for both:
    two ``--no-overlap`` runs in one process differed by 8e-5 (relative) in the second update's
    critic loss on the H100 (atomics in attention backward kernels); ``--overlap`` runs were bit
    for bit equal to the other ``--no-overlap`` runs."""
    runs = {}
    for flags in (("--cuda-graphs", "--overlap"), ("--cuda-graphs", "--no-overlap"), ("--no-cuda-graphs",)):
        out = tmp_path / "_".join(f.strip("-") for f in flags)
        argv = [("cuda" if a == "cpu" else a) for a in ARGS] + ["--updates", "2", "--data", str(data), "--out", str(out), *flags]
        assert main(argv) == 0
        runs[flags] = read_metrics(out)
    keys = ("loss_value", "loss_gate", "loss_budget", "loss_selector", "entropy_gate", "entropy_budget",
            "entropy_selector", "return_mean", "compression")
    overlap, serial, eager = runs.values()
    assert len(overlap) == len(serial) == 2
    for a, b, c in zip(overlap, serial, eager):
        assert a["interventions"] > 0  # the rollouts pruned: controller steps ran
        for k in keys:
            assert abs(b[k] - c[k]) <= 1e-3 * max(1.0, abs(c[k])), (b["update"], k, b[k], c[k])
            assert abs(a[k] - b[k]) <= 1e-3 * max(1.0, abs(b[k])), (a["update"], k, a[k], b[k])


def test_minibatch_buffers_are_allocated_once(data, tmp_path):
    """The PPO steps' static buffers keep their storage from one update to the next (a captured
    CUDA graph reads them by address: new storage would force a new capture every update)."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    tr = Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path)])))
    batches = (tr.gate_batch, tr.ctrl_batch, tr.critic_batch)

    def storage():
        return {(i, k): getattr(b, k).data_ptr() for i, b in enumerate(batches) for k in b.shapes}

    tr.step()
    first = storage()
    assert {k for _, k in first} >= {"tokens", "vg", "target", "keys", "order", "cls_key", "adv"}
    tr.step()
    assert storage() == first


def test_cli_errors_are_one_line(data, tmp_path, capsys):
    rc = main(ARGS + ["--data", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("timm-dora-train: error: ") and "missing.csv" in err
    rc = main(ARGS + ["--data", str(data), "--out", str(tmp_path / "run2"), "--cutmix-prob", "2"])
    assert rc == 1 and capsys.readouterr().err == "timm-dora-train: error: --cutmix-prob must be in [0, 1], got 2.0\n"
    rc = main(ARGS + ["--data", str(data), "--out", str(tmp_path / "run3"), "--batch-scale", "0"])
    assert rc == 1 and capsys.readouterr().err == "timm-dora-train: error: --batch-scale must be at least 1, got 0\n"
    rc = main(ARGS + ["--data", str(data), "--out", str(tmp_path / "run4"), "--strata", "4"])
    assert rc == 1 and capsys.readouterr().err == "timm-dora-train: error: --rollout-images 6 must be divisible by --strata 4\n"
    rc = main(ARGS + ["--data", str(data), "--out", str(tmp_path / "run5"), "--strata", "2", "--controller-minibatch", "1"])
    assert rc == 1 and capsys.readouterr().err == "timm-dora-train: error: --controller-minibatch 1 must be at least --strata 2\n"


@pytest.mark.parametrize("model,size,summary", [
    ("vit_wee_patch16_reg1_gap_256", 64, "mean"),  # no class token: GAP readout and a register
    ("vit_tiny_patch16_224", 48, "cls"),  # another input size: 9 patches
])
def test_cli_trains_other_families_and_sizes(data, tmp_path, model, size, summary):
    """A short CPU run for a backbone without a class token and at another input size: the selected
    actor saves, loads through from_pretrained and runs on the backbone."""
    import timm

    args = [a for a in ARGS if a not in ("vit_tiny_patch16_224", "64")]
    args[args.index("--model") + 1:args.index("--model") + 1] = [model]
    args[args.index("--img-size") + 1:args.index("--img-size") + 1] = [str(size)]
    out = tmp_path / "run"
    assert main(args + ["--data", str(data), "--out", str(out), "--updates", "2", "--checkpoint-every", "2"]) == 0
    actor = Actor.from_pretrained(out / "selected")
    backbone = timm.create_model(model, pretrained=False, img_size=size, num_classes=4).eval()
    assert (actor.summary, actor.num_patches) == (summary, (size // 16) ** 2)
    assert json.loads((out / "selected" / "config.json").read_text())["actor"].get("summary", "cls") == summary
    import timm_dora

    timm_dora.wrap(backbone, str(out / "selected"))
    with torch.no_grad():
        logits = backbone(torch.randn(2, 3, size, size))
    assert logits.shape == (2, 4) and backbone.dora_stats.gate.shape == (2, len(backbone.blocks))
    assert len(read_metrics(out)) == 2


@pytest.mark.parametrize("skip_dead", [False, True])
def test_skip_dead_rollouts_make_no_decision_at_the_last_block(skip_dead):
    """With ``skip_dead`` the actor decides nothing at the last block (no gate, no cost, an
    infeasible transition: no reward for tokens that cost nothing); the other blocks are as before.
    An actor that opens every gate with the smallest budget (2 of 36 patches at each block)."""
    import timm_dora
    from timm_dora.backbone import create_backbone
    from timm_dora.train.rollout import collect

    model = create_backbone("vit_tiny_patch16_224", img_size=96, num_classes=4)
    timm_dora.wrap(model, policy=timm_dora.NoPrune(), skip_dead=skip_dead)
    torch.manual_seed(0)
    actor = Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(1e4)
        actor.budget_head[3].bias.copy_(torch.arange(actor.num_budgets, 0, -1).float() * 1e3)  # budget 2 wins
        traj = collect(model, actor, torch.randn(4, 3, 96, 96))
    assert (traj.k[:, :-1] == 2).all()
    assert (traj.k[:, -1] == (0 if skip_dead else 2)).all()
    last = traj.block == traj.k.shape[1] - 1
    assert bool(traj.feasible[last].any()) is not skip_dead and bool(traj.gate[last].any()) is not skip_dead


def test_cli_skip_dead_trains_and_records_it(data, tmp_path):
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--updates", "2", "--checkpoint-every", "2",
                        "--skip-dead"]) == 0
    config = json.loads((out / "selected" / "config.json").read_text())
    assert config["training"]["skip_dead"] is True and len(read_metrics(out)) == 2


def test_cli_merge_trains_merging_actors_and_warm_starts_from_a_deleting_one(data, tmp_path):
    """``--merge`` (ours): the rollouts fold the removed tokens into their survivors (the trainer's
    model is wrapped with merge=True), the saved actors say so and ``wrap`` runs them that way; a
    deletion-trained actor of the same sizes may start such a run."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--updates", "2", "--checkpoint-every", "2", "--merge"]) == 0
    config = json.loads((out / "selected" / "config.json").read_text())
    assert config["actor"]["merge"] is True and len(read_metrics(out)) == 2
    args = ARGS + ["--data", str(data), "--out", str(tmp_path / "warm"), "--merge", "--init-actor", str(out / "selected")]
    trainer = Trainer(config_from_args(build_parser().parse_args(args)))
    assert trainer.model._dora.merge and trainer.actor.merge
    plain = Actor.for_model(trainer.model, **{k: v for k, v in trainer.actor.config().items()
                                              if k not in ("embed_dim", "depth", "num_patches", "merge")})
    plain.save_pretrained(tmp_path / "deleting")
    args[args.index("--init-actor") + 1] = str(tmp_path / "deleting")
    args[args.index("--out") + 1] = str(tmp_path / "warm2")
    warm = Trainer(config_from_args(build_parser().parse_args(args)))
    assert warm.actor.merge and torch.equal(warm.actor.gate_embed, plain.gate_embed)


def test_label_free_disagreement_feedback(data, tmp_path):
    """``--feedback-signal disagreement``: each check's ``d_u`` is the share of the 4 QC images whose
    top-1 differs from native's, and the coefficient follows the paper's rule with the error
    normalised by ``target_disagreement / target_drop x 0.01`` (0.2 here)."""
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--qc-shards", "1", "--feedback-signal",
                        "disagreement", "--target-disagreement", "0.2"]) == 0
    checks = [r for r in read_metrics(out) if "d_u" in r]
    assert len(checks) == 2
    a = 5.0  # --a-init
    for c in checks:
        assert round(c["d_u"] * 4) == pytest.approx(c["d_u"] * 4, abs=1e-9)  # a count of 4 images
        assert c["d_u"] == c["qc_disagreement"] >= abs(c["qc_drop"])  # a changed answer for every flip
        assert c["a_u"] == pytest.approx(a)
        a = min(max(a + 5.0 * min(max((c["d_u"] - 0.2) / 0.2, -2.0), 2.0), 0.0), 300.0)
        assert c["a_next"] == pytest.approx(a)
    # every dev checkpoint records its disagreement with native too (the calibration of the target)
    for rec in json.loads((out / "selection.json").read_text())["checkpoints"]:
        assert 0.0 <= rec["disagreement"] <= 100.0
        assert rec["disagreement"] >= abs(rec["native_top1"] - rec["top1"]) - 1e-9
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "bad"), "--feedback-signal", "kl"]) == 1


def test_feedback_on_the_rollout_pool_too_with_a_moving_average(data, tmp_path):
    """``--qc-with-rollout``: the checks read the 4 QC images and the 10 rollout images (eval
    preprocessing); ``--feedback-ema``: the coefficient follows the moving average of the drops;
    ``--selection fit`` is recorded with the selection."""
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--qc-with-rollout", "--qc-shards", "1",
                        "--feedback-ema", "0.5", "--selection", "fit"]) == 0
    from timm_dora.train import Trainer, build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path / "t"),
                                                             "--qc-with-rollout", "--qc-shards", "1"]))
    trainer = Trainer(cfg)
    assert len(trainer.images.checks) == 14 and trainer.images.check_shards[0].tolist() == list(range(14))
    checks = [r for r in read_metrics(out) if "d_u" in r]
    assert len(checks) == 2 and checks[0]["d_smoothed"] == checks[0]["d_u"]
    assert checks[1]["d_smoothed"] == pytest.approx(0.5 * checks[0]["d_u"] + 0.5 * checks[1]["d_u"])
    for d in (checks[0]["d_u"], checks[1]["d_u"]):
        assert round(d * 14) == pytest.approx(d * 14, abs=1e-9)  # a count of 14 images
    selection = json.loads((out / "selection.json").read_text())
    assert selection["rule"] == "fit" and len(selection["fitted_drops"]) == 2
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "bad"), "--selection", "lcb"]) == 1


def test_label_free_feedback_reads_every_split(data, tmp_path, capsys):
    """``--qc-with-dev`` with ``--qc-with-rollout``: the label-free checks read all 18 images, QC
    first, then rollout, then dev (the dev tensors themselves); with the paper's labelled signal it
    is refused in one line (the dev labels stay for the selection)."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    args = ARGS + ["--data", str(data), "--out", str(tmp_path / "t"), "--qc-with-rollout", "--qc-with-dev",
                   "--qc-shards", "1", "--feedback-signal", "disagreement"]
    trainer = Trainer(config_from_args(build_parser().parse_args(args)))
    checks, dev = trainer.images.checks, trainer.images.dev
    assert len(checks) == 18 and trainer.images.check_shards[0].tolist() == list(range(18))
    assert torch.equal(checks.images[-4:], dev.images) and torch.equal(checks.labels[-4:], dev.labels)
    qc_only = Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out",
                                                                         str(tmp_path / "q"), "--qc-shards", "1"])))
    assert torch.equal(checks.images[:4], qc_only.images.checks.images)
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "bad"), "--qc-with-dev"]) == 1
    assert "--qc-with-dev reads the dev images" in capsys.readouterr().err


def test_rollouts_with_the_check_images(data, tmp_path, capsys):
    """``--rollout-with-checks``: the rollout pool is the 10 rollout images, then the 4 qc and the 4
    dev images (their files and labels in that order), the checks and dev split stay as they were,
    and a run trains on it; with the paper's labelled feedback it is refused in one line."""
    from timm_dora.train import Trainer, build_parser, config_from_args

    base = ARGS + ["--data", str(data), "--qc-shards", "1", "--feedback-signal", "disagreement"]
    plain = Trainer(config_from_args(build_parser().parse_args(base + ["--out", str(tmp_path / "p")])))
    trainer = Trainer(config_from_args(build_parser().parse_args(base + ["--out", str(tmp_path / "t"), "--rollout-with-checks"])))
    rows = [line.split(",") for line in data.read_text().splitlines()[1:]]
    order = [r for s in ("rollout", "qc", "dev") for r in rows if r[4] == s]
    assert [os.path.basename(p) for p in trainer.images.pool.paths] == [r[0] for r in order]
    assert trainer.images.pool.labels == [int(r[1]) for r in order]
    assert len(plain.images.pool) == 10 and trainer.sampler.n == 18
    assert torch.equal(trainer.images.checks.images, plain.images.checks.images)
    assert torch.equal(trainer.images.dev.images, plain.images.dev.images)
    out = tmp_path / "run"
    assert main(base + ["--out", str(out), "--rollout-with-checks", "--updates", "2"]) == 0
    assert json.loads((out / "config.json").read_text())["rollout_with_checks"] is True
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "bad"), "--rollout-with-checks"]) == 1
    assert "--rollout-with-checks trains on the qc images" in capsys.readouterr().err


def test_actor_width_sizes_the_trained_actor(data, tmp_path, capsys):
    """``--actor-width 32``: the trained actor has a 32-wide encoder with 1 head, FFN 64 and a
    32 -> 16 -> 1 selector (encoder_sizes), saves that config, loads and runs on the backbone, and its
    controller costs what the layer sizes give by hand; without the flag the width is the warm
    start's, else ``auto_width``'s (by the 1.5 % rule); an unsupported width is a one-line error."""
    import timm

    import timm_dora
    from timm_dora.policy.actor_flops import actor_controller_macs
    from timm_dora.policy import encoder_sizes

    assert encoder_sizes(128) == {"width": 128, "num_heads": 4, "ffn_dim": 256, "selector_hidden": 64}
    out = tmp_path / "run"
    assert main(ARGS + ["--data", str(data), "--out", str(out), "--updates", "2", "--actor-width", "32"]) == 0
    actor = Actor.from_pretrained(out / "selected")
    assert (actor.width, actor.encoder.num_heads, actor.ffn_dim, actor.selector_hidden) == (32, 1, 64, 16)
    assert (actor.gate_hidden, actor.budget_hidden) == (64, 128)  # once per image: the paper's sizes
    # MACs at N visual tokens (N + 1 rows with the CLS key), key width d = 192, M = 6 budgets (N0 = 16):
    # per row w_in 192*32, qkv 32*96, proj 32*32, FFN 2*32*64, selector 32*16 + 16; attention 2*32 per
    # pair of rows; once: w_h 3*32, budget head 32*128 + 128*6, w_k 1*32 (the selector not on CLS)
    n = 10
    rows = n + 1
    by_hand = rows * (192 * 32 + 32 * 96 + 32 * 32 + 2 * 32 * 64) + n * (32 * 16 + 16) + rows * rows * 2 * 32 \
        + 3 * 32 + 32 * 128 + 128 * 6 + 32
    assert int(actor_controller_macs(actor, torch.tensor([n]))) == by_hand
    backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=4).eval()
    timm_dora.wrap(backbone, str(out / "selected"))
    with torch.no_grad():
        assert backbone(torch.randn(2, 3, 64, 64)).shape == (2, 4)
    # no --actor-width: the warm start's width, else auto_width's (here 64: the paper's 128 would cost
    # more than 1.5 % of this backbone's forward per intervention, 64 does not)
    from timm_dora.policy import auto_width
    from timm_dora.engine.flops import native_gflops

    assert auto_width(backbone) == 64
    for w, over in ((128, True), (64, False)):
        cost = 2 * float(actor_controller_macs(Actor.for_model(backbone, **encoder_sizes(w)), torch.tensor([16])))
        assert (cost > 0.015 * native_gflops(backbone) * 1e9) == over
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "auto"), "--updates", "2"]) == 0
    assert Actor.from_pretrained(tmp_path / "auto" / "selected").width == 64
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["actor_width"] == 64
    assert main(ARGS + ["--data", str(data), "--out", str(tmp_path / "warm"), "--updates", "2",
                        "--init-actor", str(out / "selected")]) == 0
    assert Actor.from_pretrained(tmp_path / "warm" / "selected").width == 32
    # a continued run's checkpoints name their warm start and carry its training record (provenance)
    first, warm = (json.loads((d / "selected" / "config.json").read_text())["training"] for d in (out, tmp_path / "warm"))
    assert warm["init_actor"] == str(out / "selected") and warm["init_training"] == first and warm["updates"] == 2
    assert "init_actor" not in first
    rc = main(ARGS + ["--data", str(data), "--out", str(tmp_path / "bad"), "--actor-width", "48"])
    assert rc == 1 and capsys.readouterr().err == (
        "timm-dora-train: error: --actor-width: actor width must be one of 32, 64, 128 (the paper), 256, got 48\n")


def test_recipe_auto_picks_the_small_pool_recipe_and_explicit_flags_win(data, tmp_path, capsys):
    """``--recipe auto`` (the default) on a 10-image rollout split: the small-pool recipe's settings
    (label-free feedback on every pool image, one shard, fitted selection), except those given as
    flags; ``paper`` keeps the paper's; a pool over the limit gets the paper's under ``auto``; the
    resolved recipe is what ``config.json`` records; an unknown recipe is a one-line error."""
    from timm_dora.train import RECIPES, SMALL_POOL_MAX_IMAGES, TrainConfig, build_parser, config_from_args

    args = [a for a in ARGS if a not in ("--recipe", "paper")] + ["--data", str(data)]
    cfg = config_from_args(build_parser().parse_args(args + ["--out", "o", "--target-disagreement", "0.05"]))
    assert cfg.recipe == "auto" and cfg.feedback_signal is None and cfg.qc_shards == 2  # ARGS gives --qc-shards 2
    small = cfg.resolved(10, 64)
    assert small.recipe == "small-pool"
    assert (small.feedback_signal, small.qc_with_rollout, small.qc_with_dev, small.selection) == ("disagreement", True, True, "fit")
    assert (small.qc_shards, small.checkpoint_every, small.target_disagreement) == (2, 2, 0.05)  # the flags win
    large = cfg.resolved(SMALL_POOL_MAX_IMAGES + 1, 64)
    assert large.recipe == "paper" and (large.feedback_signal, large.qc_with_rollout, large.selection) == ("drop", False, "min")
    assert TrainConfig(model="m", data="d", out="o", recipe="paper").resolved(10, 32) == TrainConfig(
        model="m", data="d", out="o", recipe="paper", actor_width=32, **RECIPES["paper"])
    assert small.actor_width == 64 and cfg.actor_width is None
    out = tmp_path / "run"
    assert main(args + ["--out", str(out), "--updates", "2"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["recipe"], saved["feedback_signal"], saved["qc_with_dev"], saved["selection"]) == (
        "small-pool", "disagreement", True, "fit")
    checks = [r for r in read_metrics(out) if "qc_disagreement" in r]
    assert checks and all("d_u" in r for r in checks)
    assert main(args + ["--out", str(tmp_path / "bad"), "--recipe", "tiny"]) == 1
    assert capsys.readouterr().err == (
        "timm-dora-train: error: --recipe must be one of ('auto', 'paper', 'small-pool'), got 'tiny'\n")


def test_a_share_of_the_batch_rolls_out_as_the_whole_batch_does(data, tmp_path):
    """Data-parallel processes roll out their shares of a batch (their rows of the batch's noise):
    a share's rollout (images 4-6 of 7) is the whole rollout's, image by image and transition by
    transition."""
    from timm_dora.engine.patch import run
    from timm_dora.policy import NoPrune, RolloutNoise
    from timm_dora.train import Trainer, build_parser, config_from_args
    from timm_dora.train.rollout import collect

    tr = Trainer(config_from_args(build_parser().parse_args(ARGS + ["--data", str(data), "--out", str(tmp_path)])))
    with torch.no_grad():
        for p in tr.actor.gate_mlp.parameters():  # gates open for about half the transitions
            p.normal_(0, 0.3)
    x = torch.cat([tr.images.made_here(1, torch.arange(7))])
    noise = RolloutNoise.draw(tr.depth, 7, tr.actor.num_budgets, tr.num_patches, tr.gen, tr.dev)

    def rollout(rows):
        xs = x[rows]
        with torch.no_grad():
            return collect(tr.model, tr.actor, xs, z_native=run(tr.model, xs, NoPrune())[0].float(), noise=noise.rows(rows))

    whole, share = rollout(torch.arange(7)), rollout(torch.arange(4, 7))
    assert 0 < whole.ctrl_t.numel() < 7 * tr.depth
    assert torch.equal(share.k, whole.k[4:])
    assert torch.allclose(share.gflops, whole.gflops[4:]) and torch.allclose(share.z_final, whole.z_final[4:], atol=1e-5)

    def images_4_to_6(t):  # per-transition rows (t = l * B + b) of images 4-6
        return t.reshape(tr.depth, 7, *t.shape[1:])[:, 4:].reshape(-1, *t.shape[1:])

    for name in ("feasible", "gate", "token_lengths"):
        assert torch.equal(getattr(share, name), images_4_to_6(getattr(whole, name))), name
    for name in ("cls_key", "h", "gate_logp_old"):
        assert torch.allclose(getattr(share, name), images_4_to_6(getattr(whole, name)), rtol=1e-4, atol=1e-5), name
    rows = images_4_to_6(whole.ctrl_of)
    rows = rows[rows >= 0]  # the whole rollout's controller rows of images 4-6, in the share's order
    assert rows.numel() == share.ctrl_t.numel() > 0
    assert torch.equal(share.budget_index, whole.budget_index[rows])
    assert torch.allclose(share.selector_logp_old, whole.selector_logp_old[rows], rtol=1e-4, atol=1e-5)
