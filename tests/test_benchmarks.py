"""The throughput benchmark script still runs (CPU smoke test; real numbers come from the GPU)."""
import gzip
import json
import math
import re
import sys
from pathlib import Path

import pytest

from benchmarks import throughput
from benchmarks.common import interpolate, matched_counts, oracle_gflops, paired_gap, rounded
from helpers import needs_shared


def test_throughput_script_runs_every_configuration(tmp_path):
    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--blocks", "1", "2",
                     "--spread", "4", "--reductions", "0.4", "--out", str(out)])
    res = json.loads(out.read_text())
    configs = [r["config"] for r in res["rows"]]
    assert configs[:3] == ["native", "gate_off", "gate_off_spec"] and any(c.startswith("oracle") for c in configs)
    rows = {r["config"].split("@")[0]: r for r in res["rows"]}
    for plain, spec in (("gate_off", "gate_off_spec"), ("actor(random)", "actor_spec(random)")):
        assert rows[spec]["gflops"] == rows[plain]["gflops"]  # the speculative MLP is not counted
    assert rows["actor_spec(random)"]["gate_rate"] == rows["actor(random)"]["gate_rate"]
    fixed = next(r for r in res["rows"] if r["config"].startswith("fixed"))
    oracle = next(r for r in res["rows"] if r["config"].startswith("oracle"))
    assert abs(fixed["gflops"] - oracle["gflops"]) / fixed["gflops"] < 0.05  # equal-GFLOPs reference
    assert all(r["images_per_s"] > 0 for r in res["rows"])
    # the actor's own oracle: at its realized GFLOPs (the actor's FLOPs included), same blocks
    actor, matched = rows["actor(random)"], rows["oracle(actor)"]
    assert sorted(int(l) for l in matched["static_k"]) == [1, 2]
    assert abs(matched["gflops"] - actor["gflops"]) / actor["gflops"] < 0.02


def test_throughput_run_ahead_ab(tmp_path):
    """``--run-ahead on off`` measures the graph rows with and without the run ahead in one run (same
    decisions, so the same GFLOPs) and gives the defaults back."""
    from timm_dora.engine.options import EngineOptions, active

    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--blocks", "1", "2",
                     "--spread", "4", "--reductions", "0.4", "--configs", "gate_off", "gate_off_graphs",
                     "actor_graphs", "--run-ahead", "on", "off", "--out", str(out)])
    rows = {re.sub(r"@\d+%", "", r["config"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["actor_graphs(random)[run_ahead=off]", "actor_graphs(random)[run_ahead=on]", "gate_off",
                            "gate_off_graphs[run_ahead=off]", "gate_off_graphs[run_ahead=on]"]
    for config in ("gate_off_graphs", "actor_graphs(random)"):
        on, off = rows[config + "[run_ahead=on]"], rows[config + "[run_ahead=off]"]
        assert on["gflops"] == off["gflops"]
    assert active() == EngineOptions()  # (the defaults again after the A/B)


def test_throughput_mlp_chunks_ab(tmp_path):
    """``--mlp-chunks 1 2``: every graph row once per setting (the eager rows once), with the same
    GFLOPs, and the defaults given back."""
    from timm_dora.engine.options import EngineOptions, active

    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--blocks", "1", "2",
                     "--spread", "4", "--reductions", "0.4", "--configs", "gate_off", "gate_off_graphs",
                     "fixed_graphs", "actor_graphs", "--mlp-chunks", "1", "2", "--out", str(out)])
    rows = {re.sub(r"@\d+%", "", r["config"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["actor_graphs(random)[mlp_chunks=1]", "actor_graphs(random)[mlp_chunks=2]", "fixed_graphs[mlp_chunks=1]",
                            "fixed_graphs[mlp_chunks=2]", "gate_off", "gate_off_graphs[mlp_chunks=1]",
                            "gate_off_graphs[mlp_chunks=2]"]
    for config in ("gate_off_graphs", "fixed_graphs", "actor_graphs(random)"):
        assert rows[config + "[mlp_chunks=1]"]["gflops"] == rows[config + "[mlp_chunks=2]"]["gflops"]
    assert active() == EngineOptions()


def test_throughput_reduction_with_its_own_blocks(tmp_path):
    assert throughput.parse_reduction("0.55@1,4,7", [3, 6, 9]) == (0.55, [1, 4, 7])
    assert throughput.parse_reduction("0.38", [3, 6, 9]) == (0.38, [3, 6, 9])
    for bad, msg in (("0.5@a", "is not R or R@b"), ("1.5", "must be in (0, 1)")):
        try:
            throughput.parse_reduction(bad, [3])
        except SystemExit as e:
            assert msg in str(e)
        else:
            raise AssertionError(bad)
    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--spread", "2",
                     "--reductions", "0.3@2,5", "--configs", "fixed", "oracle", "actor", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    fixed = next(r for r in rows if r["config"].startswith("fixed"))
    oracle = next(r for r in rows if r["config"].startswith("oracle"))
    actor = next(r for r in rows if r["config"].startswith("actor"))
    assert fixed["blocks"] == [2, 5] and sorted(int(k) for k in oracle["static_k"]) == [2, 5]
    assert [l for l, r in enumerate(actor["gate_rate"]) if r > 0] == [2, 5]


def test_matched_oracle_counts():
    """``matched_counts``: the static schedule scaled to a GFLOPs target, against a brute-force
    search over the same family of schedules (``round(m * base)``), and unchanged at its own GFLOPs."""
    import timm

    from timm_dora.engine.flops import backbone_cost

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=96)  # 36 patches
    base = {1: 6.0, 2: 3.0}
    assert matched_counts(model, base, oracle_gflops(model, {1: 6, 2: 3})) == {1: 6, 2: 3}
    native = oracle_gflops(model, {})
    for target in (0.9 * native, 0.7 * native, 0.5 * native):
        got = matched_counts(model, base, target)
        family = [{1: min(round(m / 100 * 6), 32), 2: max(0, min(round(m / 100 * 3), 32 - min(round(m / 100 * 6), 32)))}
                  for m in range(0, 2000)]
        best = min(abs(oracle_gflops(model, ks) - target) for ks in family)
        assert abs(oracle_gflops(model, got) - target) == best
        assert got[1] >= got[2]  # the shape of the base schedule is kept
    # the GFLOPs of a schedule, by hand: the MLP (and everything after block 1's attention) runs on
    # the survivors; 36 patches + CLS, embed 192, MLP 768, 3 heads
    d, h = 192, 768

    def block(n_in, n_out):
        return n_in * 3 * d * d + 2 * n_in * n_in * d + n_in * d * d + 2 * n_out * d * h

    cost = backbone_cost(model)
    macs = cost.patch_macs + cost.head_macs + block(37, 37) + block(37, 31) + 10 * block(31, 31)
    assert oracle_gflops(model, {1: 6}) == 2 * macs / 1e9


def test_throughput_rows_per_attention_backend(tmp_path):
    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--spread", "2",
                     "--reductions", "0.3@2,5", "--configs", "gate_off", "fixed", "--attn-backends", "auto",
                     "sdpa_loop", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    configs = [r["config"] for r in rows]
    assert configs[:2] == ["gate_off[auto]", "gate_off[sdpa_loop]"]
    assert len(configs) == 4 and configs[2].startswith("fixed@") and configs[2].endswith("[auto]")
    assert configs[3].endswith("[sdpa_loop]") and all(r["backend"] == "sdpa_loop" for r in rows)  # auto on CPU
    assert rows[2]["gflops"] == rows[3]["gflops"]


def test_throughput_actor_rows_per_controller(tmp_path):
    out = tmp_path / "t.json"
    throughput.main(["--models", "vit_tiny_patch16_224", "--img-size", "96", "--batch", "8", "--batches", "2",
                     "--warmup", "1", "--iters", "1", "--repeats", "1", "--device", "cpu", "--spread", "2",
                     "--reductions", "0.3@2,5", "--configs", "actor", "--controllers", "auto", "modules",
                     "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    configs = [r["config"] for r in rows]
    assert len(configs) == 2 and configs[0].startswith("actor(random)@") and configs[0].endswith("[auto]")
    assert configs[1] == configs[0].replace("[auto]", "[modules]")
    # on the CPU both run the modules (the eager controller): equal decisions, equal GFLOPs
    assert rows[0]["gflops"] == rows[1]["gflops"] and rows[0]["gate_rate"] == rows[1]["gate_rate"]


@needs_shared
def test_trained_oracle_matches_the_published_actors_gflops(tmp_path):
    """The published ViT-Ti actor on real rollout images (CPU, a smoke run of the timing): its
    eager and graph rows decide alike (same GFLOPs), and the oracle is the dense static schedule
    at its GFLOPs: within one token of one block, at the blocks where the actor removed tokens."""
    from benchmarks import trained_oracle
    from helpers import SHARED

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    out = tmp_path / "o.json"
    res = trained_oracle.main([
        "--model", name, "--weights", str(SHARED / "weights" / f"{name}.safetensors"),
        "--actor", str(Path(__file__).resolve().parents[1] / "timm_dora" / "hub" / "actors" / name),
        "--data", str(SHARED / "data" / "imagenet-mini" / "labels.csv"), "--split", "rollout",
        "--batch", "4", "--batches", "2", "--warmup", "1", "--iters", "1", "--repeats", "1",
        "--device", "cpu", "--out", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["native", "actor", "actor_graphs", "oracle(actor)"] == [r["config"] for r in res["rows"]]
    actor, oracle = rows["actor"], rows["oracle(actor)"]
    assert actor["gflops"] == rows["actor_graphs"]["gflops"] < rows["native"]["gflops"]
    one_token = rows["native"]["gflops"] / 197  # a token through every block: an upper bound on one token's share
    assert abs(oracle["gflops"] - actor["gflops"]) < one_token
    pruned = {l for l, v in enumerate(actor["removed_per_block"]) if v > 0}
    assert {int(l) for l, k in oracle["static_k"].items() if k > 0} <= pruned


def test_train_speed_script_runs_and_splits_updates_into_phases(tmp_path):
    """benchmarks/train_speed.py on a small DeiT-B (CPU smoke test; real numbers come from the GPU)."""
    from benchmarks import train_speed
    labels = tmp_path / "labels.csv"
    root = tmp_path
    from PIL import Image
    import torch

    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i, split in enumerate(["rollout"] * 6 + ["qc"] * 2 + ["dev"] * 2):
        Image.fromarray((torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()).save(root / f"{i}.png")
        rows.append(f"{i}.png,{i % 4},n{i % 4:08d},x,{split}")
    labels.write_text("\n".join(rows) + "\n")
    small = ["--img-size", "48", "--num-classes", "4", "--rollout-images", "6", "--checkpoint-every", "2",
             "--feedback-cadence", "2", "--qc-shards", "2", "--gate-minibatch", "16", "--controller-minibatch", "4",
             "--critic-minibatch", "16", "--actor-epochs", "2", "--critic-epochs", "2", "--a-init", "5"]
    out = tmp_path / "speed.json"
    train_speed.main(["--data", str(labels), "--configs", "deit_base_random", "--updates", "3", "--warmup", "1",
                      "--device", "cpu", "--extra", " ".join(small),
                      "--out", str(out)])
    res = json.loads(out.read_text())
    r = res["configs"]["deit_base_random"]
    assert res["device_type"] == "cpu" and r["measured_updates"] == 3 and len(r["updates"]) == 4
    assert {"data", "native", "rollout", "shadows", "old_values", "actor_update", "critic_update"} <= set(r["phases"])
    assert r["feedback_s"] is not None and r["checkpoint_s"] > 0
    for u in r["updates"]:
        assert abs(u["update_s"] - sum(u["phases"].values())) < 1e-9
    # the full recipe: setup + the warm-up update's excess (compiling, capturing) + 1,171 updates + a
    # feedback check every 2 and a checkpoint every 2 updates
    cadence = int(r["flags"][r["flags"].index("--feedback-cadence") + 1])
    every = 2
    s_plain = r["s_per_update_without_feedback"]
    assert r["one_time_s"] == max(r["updates"][0]["update_s"] - s_plain, 0.0)
    expect = (r["setup_s"] + r["one_time_s"] + 1171 * s_plain + (1171 // cadence) * r["feedback_s"]
              + math.ceil(1171 / every) * r["checkpoint_s"]) / 60
    assert abs(r["full_recipe_min"] - expect) < 1e-9


@needs_shared
def test_resolution_transfer_script_runs_the_published_actor_at_other_sizes(tmp_path):
    """A smoke run (CPU, 8 test images): at 192 px the published ViT-Ti actor removes counts from its
    grid scaled to 144 patches, and native is counted at 144 patches."""
    from benchmarks import resolution_transfer
    from helpers import SHARED

    from timm_dora import Actor, native_gflops
    from timm_dora.evaluate import load_model

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    weights = SHARED / "weights" / f"{name}.safetensors"
    res = resolution_transfer.main(["--weights", str(weights), "--data", str(SHARED / "data" / "imagenet-mini" / "labels.csv"),
                                    "--sizes", "192", "--limit", "8", "--batch", "4", "--workers", "0", "--device", "cpu",
                                    "--out", str(tmp_path / "r.json")])
    (row,) = res["rows"]
    assert (row["size"], row["patches"], row["n_images"]) == (192, 144, 8)
    assert row["native_gflops"] == pytest.approx(native_gflops(load_model(name, str(weights)), 144), rel=1e-12)
    grid = set(Actor.from_pretrained(Path(__file__).resolve().parents[1] / "timm_dora" / "hub" / "actors" / name).grid(144).tolist())
    assert all(b["budget_min"] in grid and b["budget_max"] in grid for b in row["per_block"] if b["gate_rate"] > 0)
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["dora_top1"] == row["dora_top1"]


def test_tradeoff_interpolates_a_sweep_by_hand():
    pts = [(2.0, 1.5), (1.0, 5.0), (2.5, 0.5)]  # unsorted on purpose
    assert interpolate(pts, 1.5) == pytest.approx(3.25)
    assert interpolate(pts, 2.25) == pytest.approx(1.0)
    assert interpolate(pts, 2.5) == pytest.approx(0.5)
    assert interpolate(pts, 0.9) is None and interpolate(pts, 2.6) is None


def test_paired_gap_by_hand():
    """Correct per image: the method [1, 1, 0, 0], the other [1, 0, 1, 1]: the other's top-1 minus
    the method's is (0 - 1 + 1 + 1) / 4 = 25 pp; the per-image differences' population sd is
    sqrt(2.75 / 4), so the standard error is 100 * sqrt(0.6875) / 2 pp."""
    import torch

    labels = torch.tensor([1, 2, 0, 0])
    gap = paired_gap(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 0, 0]), labels)
    assert gap["drop_gap_pp"] == pytest.approx(25.0)
    assert gap["drop_gap_se_pp"] == pytest.approx(100 * 0.6875 ** 0.5 / 2)


def _tiny_backbone_and_images(tmp_path, splits):
    """A random DeiT-Ti at 64 px with 5 classes (``tmp_path/w.safetensors``) and one random image per
    entry of ``splits`` in ``tmp_path/labels.csv``; returns the model."""
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from timm_dora.evaluate import load_model

    model = load_model("deit_tiny_patch16_224", random_weights=True, img_size=64, num_classes=5)
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i, split in enumerate(splits):
        Image.fromarray((torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{i % 5},n{i % 5:08d},x,{split}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    return model


def test_the_static_sweep_must_span_half_to_twice_the_dora_saving_in_one_family():
    from benchmarks import tradeoff

    rows = [{"family": "a", "gflops_reduction_pct": r} for r in (10, 30, 45)] + \
           [{"family": "b", "gflops_reduction_pct": r} for r in (20, 70)]
    assert tradeoff._static_covers(rows, 22.5)  # a: 10 <= 11.25 and 45 >= 45
    assert not tradeoff._static_covers(rows, 23.0)  # a stops at 45 < 46, b starts at 20 > 11.5
    assert not tradeoff._static_covers(rows, 35.0)  # 10-70 only across the two families


def test_tradeoff_rounds_records_to_six_significant_digits():
    rec = {"a": 79.84615384615384, "b": [0.0012345678, 3, "x", (1.0, 2.5e-12)], "c": {"d": 123456789.0, "e": True}}
    assert rounded(rec) == {"a": 79.8462, "b": [0.00123457, 3, "x", [1.0, 2.5e-12]], "c": {"d": 123457000.0, "e": True}}


def test_tradeoff_script_tables_are_paired_and_publish_by_dev(tmp_path, monkeypatch):
    """benchmarks/tradeoff.py on a tiny random backbone (CPU): the seed published is the dev rule's
    (never the test split's), every row is paired against the same native predictions, GFLOPs are
    the accounting's own, and the skip_dead tables change GFLOPs only."""
    from benchmarks import tradeoff
    import torch

    from timm_dora import Actor, native_gflops
    from timm_dora.evaluate.baselines.static import static_gflops

    name = "deit_tiny_patch16_224"
    model = _tiny_backbone_and_images(tmp_path, ["test"] * 12)
    # seed 0: fewest dev GFLOPs but 2 pp over the target; seed 1: within it; seed 2: within, more GFLOPs
    dev = {0: (70.0, 72.0, 1.0), 1: (72.0, 72.0, 1.2), 2: (73.0, 72.0, 1.3)}
    actors = []
    for seed, (top1, native, gfl) in dev.items():
        torch.manual_seed(seed)
        Actor.for_model(model).save_pretrained(tmp_path / f"s{seed}", backbone=model, extra={
            "dev_top1": top1, "dev_native_top1": native, "dev_gflops": gfl})
        actors.append(f"{seed}={tmp_path / f's{seed}'}")
    built, build = [], tradeoff.build_method  # every DORA method's executor option: one for all rows

    def recording_build(model, method, **kw):
        if method in ("dora", "random"):
            built.append((method, kw["cuda_graphs"]))
        return build(model, method, **kw)

    monkeypatch.setattr(tradeoff, "build_method", recording_build)
    res = tradeoff.main(["--model", name, "--weights", str(tmp_path / "w.safetensors"), "--img-size", "64",
                         "--num-classes", "5", "--data", str(tmp_path / "labels.csv"), "--device", "cpu", "--workers", "0",
                         "--batch", "5", "--seed-actors", *actors, "--checkpoints", str(tmp_path / "s2"),
                         "--static-blocks", "3,6,9", "--static-reductions", "20", "40", "--tome-r", "1", "2",
                         "--out", str(tmp_path / "t.json")])
    assert res["published_seed"]["seed"] == 1 and res["dora"]["seed"] == 1
    assert sorted(built) == [("dora", None)] * 5 + [("random", None)] * 2 and res["dora_cuda_graphs"] is None
    assert res["n_images"] == 12 and json.loads((tmp_path / "t.json").read_text())["dora"]["seed"] == 1
    assert res["native"]["gflops"] == pytest.approx(native_gflops(model), rel=1e-12)
    assert res["skip_dead"]["native"]["gflops"] == pytest.approx(native_gflops(model, skip_dead=True), rel=1e-12)
    assert [s["seed"] for s in res["dora"]["seeds"]] == [0, 1, 2]
    assert res["dora"]["drop_pp"] == res["dora"]["seeds"][1]["drop_pp"]
    assert res["checkpoints"][0]["drop_pp"] == res["dora"]["seeds"][2]["drop_pp"]  # the same actor, the same images
    rowsets = [res["dora"]["seeds"], res["static"], res["tome"], [res["random_selector"]], res["checkpoints"]]
    for row in (r for rs in rowsets for r in rs):
        assert row["drop_pp"] == pytest.approx(res["native"]["top1"] - row["top1"], abs=1e-9)
        assert row["gflops_reduction_pct"] == pytest.approx(100 * (1 - row["gflops"] / res["native"]["gflops"]), abs=1e-9)
    for s in res["static"]:
        sched = {int(b): int(k) for b, k in (p.split(":") for p in s["schedule"].split(","))}
        assert s["gflops"] == pytest.approx(static_gflops(model, sched), rel=1e-12)
    assert [t["r"] for t in res["tome"]] == [1, 2]
    d = res["dora"]
    # the pairing with ToMe: the gap is the difference of the two drops, on the same images
    assert [v["r"] for v in d["vs_tome"]] == [1, 2]
    for v, tm in zip(d["vs_tome"], res["tome"]):
        assert v["drop_gap_pp"] == pytest.approx(d["drop_pp"] - tm["drop_pp"], abs=1e-9) and v["gflops"] == tm["gflops"]
    for s in d["seeds"]:
        near = min(res["tome"], key=lambda tm: abs(tm["gflops"] - s["gflops"]))
        assert s["vs_tome_nearest"]["r"] == near["r"]
        assert s["vs_tome_nearest"]["drop_gap_pp"] == pytest.approx(s["drop_pp"] - near["drop_pp"], abs=1e-9)
    assert d["gflops_p10"] <= d["gflops_p90"]
    assert d["spread_pct_of_native"] == pytest.approx(100 * (d["gflops_p90"] - d["gflops_p10"]) / res["native"]["gflops"])
    # skip_dead: identical predictions (the CLS readout never reads the rows it leaves out), fewer GFLOPs
    sd = res["skip_dead"]
    for a, b in [(res["dora"], sd["dora"]), (res["random_selector"], sd["random_selector"])] + list(zip(res["tome"], sd["tome"])):
        assert a["top1"] == b["top1"] and b["gflops"] < a["gflops"]
    assert set(res["targets"]) == {"drop_pp_le_1", "gflops_reduction_pct_ge_30", "dominates_static",
                                   "random_selector_1pp_worse", "per_image_spread_ge_5pct", "static_covers_half_to_twice"}
    reds = [s["gflops_reduction_pct"] for s in res["static"]]  # one family here
    assert res["targets"]["static_covers_half_to_twice"] == (min(reds) <= d["gflops_reduction_pct"] / 2
                                                             and max(reds) >= 2 * d["gflops_reduction_pct"])


def test_choose_seed_rule_by_hand():
    """benchmarks/choose_seed.py's rule: the lowest pool drop among the seeds with the spread and the
    reduction (ties: fewer GFLOPs); else the largest reduction among those with the spread (violates);
    else among all."""
    from benchmarks import choose_seed

    def row(drop, red, spread, gflops=1.6):
        return {"drop_pp": drop, "gflops_reduction_pct": red, "spread_pct_of_native": spread, "gflops": gflops}

    rows = {"a": row(0.5, 36.0, 6.0), "b": row(0.3, 34.0, 7.0), "c": row(0.2, 40.0, 2.0), "d": row(0.5, 37.0, 8.0, 1.58)}
    assert choose_seed.choose(rows, 35.5, 5.0) == ("d", False)  # b lacks the reduction, c the spread; d ties a, fewer GFLOPs
    assert choose_seed.choose(rows, 35.5, 0.0) == ("c", False)
    short = {"a": row(0.1, 30.0, 6.0), "b": row(0.5, 33.0, 2.0), "c": row(0.9, 32.0, 5.0)}
    assert choose_seed.choose(short, 35.0, 5.0) == ("c", True)
    assert choose_seed.choose({"a": row(0.1, 30.0, 1.0), "b": row(0.5, 31.0, 2.0)}, 35.0, 5.0) == ("b", True)
    with pytest.raises(ValueError, match="no seeds"):
        choose_seed.choose({}, 35.0, 5.0)
    # the incumbent is replaced only by a choice within the rule that drops no more on the same images
    assert choose_seed.replaces(False, 0.0) and choose_seed.replaces(False, -0.5)
    assert not choose_seed.replaces(False, 0.1) and not choose_seed.replaces(True, -1.0)


def test_choose_seed_script_chooses_on_the_pool_and_tradeoff_publishes_its_choice(tmp_path):
    """benchmarks/choose_seed.py on a tiny random backbone (CPU) reads the pool splits only, pairs
    every seed against native on them and records the rule's choice; tradeoff.py --choice publishes
    that seed on test, and refuses a record made for other seeds or a pool with test in it."""
    from benchmarks import choose_seed
    from benchmarks import tradeoff
    import torch

    from timm_dora import Actor

    name = "deit_tiny_patch16_224"
    model = _tiny_backbone_and_images(tmp_path, ["rollout"] * 6 + ["dev"] * 4 + ["test"] * 5)
    actors = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        Actor.for_model(model).save_pretrained(tmp_path / f"s{seed}", backbone=model, extra={
            "dev_top1": 70.0, "dev_native_top1": 70.0, "dev_gflops": 1.0})
        actors.append(f"{seed}={tmp_path / f's{seed}'}")
    common = ["--model", name, "--weights", str(tmp_path / "w.safetensors"), "--img-size", "64", "--num-classes", "5",
              "--data", str(tmp_path / "labels.csv"), "--device", "cpu", "--workers", "0", "--batch", "4"]
    rec = choose_seed.main([*common, "--splits", "rollout", "dev", "--seed-actors", *actors, "--min-reduction", "0",
                            "--min-spread", "0", "--out", str(tmp_path / "c.json")])
    assert rec["n_images"] == 10 and [s["seed"] for s in rec["seeds"]] == [0, 1, 2]
    for s in rec["seeds"]:
        assert s["drop_pp"] == pytest.approx(rec["native"]["top1"] - s["top1"], abs=1e-9)
    best = min(rec["seeds"], key=lambda s: (s["drop_pp"], s["gflops"]))
    assert rec["chosen"] == {"seed": best["seed"], "violates": False} and "incumbent" not in rec
    assert rec["dtype"] == "float32"  # --precision auto on the CPU; bf16 where asked (the test table's dtype)
    half = choose_seed.main([*common, "--splits", "dev", "--seed-actors", *actors[:1], "--min-reduction", "0",
                             "--min-spread", "0", "--precision", "bf16"])
    assert half["dtype"] == "bfloat16" and half["n_images"] == 4
    worst = max(rec["seeds"], key=lambda s: (s["drop_pp"], s["gflops"]))
    for inc in (best, worst):  # the incumbent on the same images: its own row, the paired gap, the verdict
        r = choose_seed.main([*common, "--splits", "rollout", "dev", "--seed-actors", *actors, "--min-reduction", "0",
                              "--min-spread", "0", "--incumbent", inc["actor"]])["incumbent"]
        assert {k: r[k] for k in ("top1", "drop_pp", "gflops")} == {k: inc[k] for k in ("top1", "drop_pp", "gflops")}
        assert r["gap"]["drop_gap_pp"] == pytest.approx(best["drop_pp"] - inc["drop_pp"], abs=1e-9)
        assert r["replace"] == (r["gap"]["drop_gap_pp"] <= 0.0)
    res = tradeoff.main([*common, "--seed-actors", *actors, "--choice", str(tmp_path / "c.json"), "--static-blocks", "3,6,9",
                         "--static-reductions", "20", "--tome-r", "1", "1"])
    assert res["dora"]["seed"] == best["seed"] and res["published_seed"]["choice"] == str(tmp_path / "c.json")
    assert res["n_images"] == 5 and res["published_seed"]["n_images"] == 10
    with pytest.raises(ValueError, match="chose among seeds"):
        tradeoff.main([*common, "--seed-actors", *actors[:2], "--choice", str(tmp_path / "c.json")])
    with pytest.raises(ValueError, match="must not include test"):
        choose_seed.main([*common, "--splits", "dev", "test", "--seed-actors", *actors, "--min-reduction", "0"])


def test_seen_unseen_compares_each_split_with_the_static_rule_at_the_same_gflops(tmp_path):
    """benchmarks/seen_unseen.py on a tiny random backbone (CPU): every split and the unseen group
    (qc + dev) paired against native; the unseen agreement is the image-weighted mean of qc's and
    dev's; the advantage is the actor's agreement minus the static sweep's, interpolated at the
    actor's GFLOPs from the recorded rows; the seen-minus-unseen gap is the difference of two."""
    from benchmarks import seen_unseen
    import torch

    from timm_dora import Actor

    from timm_dora.policy.actor import encoder_sizes

    model = _tiny_backbone_and_images(tmp_path, ["rollout"] * 5 + ["qc"] * 3 + ["dev"] * 2 + ["test"] * 2)
    torch.manual_seed(0)
    actor = Actor.for_model(model, **encoder_sizes(32))
    with torch.no_grad():  # a gate that opens for some images, two tokens at a time: inside the static sweep
        actor.gate_mlp[2].bias.fill_(-0.05)
        actor.budget_head[-1].bias[0] += 10.0
    actor.save_pretrained(tmp_path / "a", backbone=model)
    rec = seen_unseen.main(["--model", "deit_tiny_patch16_224", "--weights", str(tmp_path / "w.safetensors"),
                            "--img-size", "64", "--num-classes", "5", "--data", str(tmp_path / "labels.csv"),
                            "--device", "cpu", "--workers", "0", "--batch", "4", "--static-k", "0", "1",
                            "--actors", f"a={tmp_path / 'a'}", "--out", str(tmp_path / "s.json")])
    assert rec["n_images"] == {"rollout": 5, "qc": 3, "dev": 2}
    a = rec["actors"]["a"]
    assert [a[g]["n_images"] for g in ("rollout", "qc", "dev", "unseen")] == [5, 3, 2, 5]
    assert a["unseen"]["agreement"] == pytest.approx((3 * a["qc"]["agreement"] + 2 * a["dev"]["agreement"]) / 5)
    assert rec["static"]["rollout"][0]["agreement"] == 100.0 and rec["static"]["rollout"][0]["gflops"] == rec["native_gflops"]
    for g in ("rollout", "unseen"):
        pts = sorted((r["gflops"], r["agreement"]) for r in rec["static"][g])
        at = next(d0 + (d1 - d0) * (a[g]["gflops"] - g0) / (g1 - g0) for (g0, d0), (g1, d1) in zip(pts, pts[1:])
                  if g0 <= a[g]["gflops"] <= g1)
        assert a[g]["static_agreement"] == pytest.approx(at, abs=1e-4)
        assert a[g]["advantage_pp"] == pytest.approx(a[g]["agreement"] - at, abs=1e-4)
    assert a["seen_minus_unseen_pp"] == pytest.approx(a["rollout"]["advantage_pp"] - a["unseen"]["advantage_pp"], abs=1e-4)


def test_tradeoff_publishes_among_the_seeds_with_the_dev_spread(tmp_path):
    """The dev rule runs among the seeds whose recorded dev spread reaches the minimum (records
    without one count as qualifying); with none qualifying, among all of them."""
    from benchmarks import tradeoff

    def seed(name, gflops, spread, top1=72.0):
        (tmp_path / name).mkdir()
        training = {"dev_top1": top1, "dev_native_top1": 72.0, "dev_gflops": gflops}
        if spread is not None:
            training["dev_spread_pct"] = spread
        (tmp_path / name / "config.json").write_text(json.dumps({"training": training}))
        return str(tmp_path / name)

    actors = {"0": seed("a", 1.0, 1.2), "1": seed("b", 1.1, 6.0), "2": seed("c", 1.05, None), "3": seed("d", 0.9, 7.0, 70.0)}
    choice, dev = tradeoff.choose_seed(actors, 1.0, 5.0)  # 0 lacks the spread, 3 the accuracy
    assert choice.record.name == "2" and not choice.violates
    assert {s: d["spread_pct"] for s, d in dev.items()} == {"0": 1.2, "1": 6.0, "2": None, "3": 7.0}
    assert dev["3"] == {"name": "3", "top1": 70.0, "native_top1": 72.0, "gflops": 0.9, "disagreement": None, "spread_pct": 7.0}
    assert tradeoff.choose_seed(actors, 1.0, 0.0)[0].record.name == "0"  # no minimum: the paper's rule alone
    narrow = {"0": actors["0"], "4": seed("e", 0.95, 2.0)}
    assert tradeoff.choose_seed(narrow, 1.0, 5.0)[0].record.name == "4"  # none qualifies: all of them


def test_pool_studies_merge_averages_by_size_into_the_most_similar_survivor():
    """benchmarks/pool_studies.py's merge: a removed row goes into the kept visual row of its image
    with the highest cosine similarity, averaged by size (hand-computed), and the sizes follow."""
    from benchmarks import pool_studies
    import torch

    from timm_dora.engine.packing import Packed

    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0], [5.0, 0.0]])  # CLS, then 4 patches
    packed = Packed.from_dense(x[None], 1)
    remove = torch.tensor([False, False, False, True, False])
    m = pool_studies.Merging("x", prop=False)
    m.sizes = torch.tensor([1.0, 1.0, 3.0, 1.0, 1.0])  # the row [0, 1] already holds three patches
    out = m.delete_rows(packed, remove, torch.tensor([1]), [1])
    expected = torch.tensor([[1.0, 0.0], [1.0, 0.1], [(0.0 * 3 + 0.1) / 4, 1.0], [5.0, 0.0]])
    assert torch.allclose(out.x, expected) and out.lengths_host == [4]
    assert m.sizes.tolist() == [1.0, 1.0, 4.0, 1.0]


def test_pool_studies_fusion_keeps_one_size_weighted_row_per_image():
    """benchmarks/pool_studies.py's fuse: the first removal revives the image's first removed row
    as the size-weighted mean of all it removes (one removal fewer, in the engine's counts too); a
    later removal is averaged into that row (hand-computed)."""
    from benchmarks import pool_studies
    import torch

    from timm_dora.engine.packing import Packed

    x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [2.0, 2.0]],    # CLS, a, b, c
                      [[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [1.0, 1.0]]])   # CLS, d, e, f
    f = pool_studies.Fusion(prop=False)
    f.sizes, f.fused, f.n_visual = torch.ones(8), torch.zeros(8, dtype=torch.bool), torch.tensor([1, 2])
    removed = torch.tensor([2, 1])
    out = f.delete_rows(Packed.from_dense(x, 1), torch.tensor([0, 0, 1, 1, 0, 0, 1, 0], dtype=torch.bool), removed)
    assert out.lengths_host == [3, 4] and removed.tolist() == [1, 0] and f.n_visual.tolist() == [2, 3]
    assert torch.equal(out.x, torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.5], [0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [1.0, 1.0]]))
    assert f.sizes.tolist() == [1, 1, 2, 1, 1, 1, 1] and f.fused.tolist() == [False, False, True, False, False, True, False]
    removed = torch.tensor([1, 0])  # image 0 removes a: averaged into its fused row (size 2)
    out = f.delete_rows(out, torch.tensor([0, 1, 0, 0, 0, 0, 0], dtype=torch.bool), removed)
    assert out.lengths_host == [2, 4] and removed.tolist() == [1, 0] and f.n_visual.tolist() == [2, 3]
    assert torch.allclose(out.x[1], torch.tensor([1.0, 1.0])) and f.sizes[:2].tolist() == [1, 3]


def test_pool_studies_script_runs_both_studies_on_the_pool(tmp_path):
    """benchmarks/pool_studies.py on a tiny random backbone: all three pool splits are read, the
    selector study's DORA row and the merge and fuse studies' deletion rows are the same forward;
    a fused row costs GFLOPs."""
    from benchmarks import pool_studies
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from timm_dora import Actor
    from timm_dora.evaluate import load_model

    name = "deit_tiny_patch16_224"
    model = load_model(name, random_weights=True, img_size=64, num_classes=5)
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i, split in enumerate(["rollout"] * 4 + ["qc"] * 2 + ["dev"] * 2):
        Image.fromarray((torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{i % 5},n{i % 5:08d},sample1000,{split}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    torch.manual_seed(0)
    Actor.for_model(model).save_pretrained(tmp_path / "a", backbone=model)
    res = pool_studies.main(["--model", name, "--weights", str(tmp_path / "w.safetensors"), "--img-size", "64",
                             "--num-classes", "5", "--data", str(tmp_path / "labels.csv"), "--workers", "0",
                             "--actors", str(tmp_path / "a"), "--studies", "selectors", "merge", "fuse",
                             "--out", str(tmp_path / "s.json")])
    study = res["actors"][str(tmp_path / "a")]
    assert res["images"] == 8 and set(study["merge"]) == set(pool_studies.MERGE_MODES)
    assert study["selectors"]["dora"] == study["merge"]["delete"] == study["fuse"]["delete"]
    assert set(study["fuse"]) == set(pool_studies.FUSE_MODES)
    assert study["fuse"]["fuse"]["gflops"] > study["fuse"]["delete"]["gflops"]
    assert set(study["selectors"]) == {"dora", "cls_sim", "similarity", "random"}


def test_train_scale_makes_a_set_runs_the_recipe_in_segments_and_summarises(tmp_path):
    """``make``: an image folder from source images, split by ``timm-dora partition --folder``
    (disjoint, the sizes asked for, files at ImageNet's shapes); ``run``: the recipe as a monitored
    process, summed into a result with the measured fields (CPU, a tiny recipe)."""
    import subprocess

    from PIL import Image

    from timm_dora.data import LabelsCSVDataset, check_disjoint

    sources = tmp_path / "sources"
    sources.mkdir()
    import torch

    g = torch.Generator().manual_seed(0)
    for c in range(5):  # noise: every crop of it a file of its own
        Image.fromarray((torch.rand(48, 64, 3, generator=g) * 255).to(torch.uint8).numpy()).save(sources / f"n0000000{c}.jpg")
    root, run = tmp_path / "set", tmp_path / "run"
    import argparse

    from benchmarks import train_scale

    train_scale.make(argparse.Namespace(sources=str(sources), root=str(root), rollout=24, qc=8, dev=8, seed=0, workers=2))
    splits = {s: LabelsCSVDataset(root / "splits.csv", s) for s in ("rollout", "qc", "dev")}
    assert {s: len(d) for s, d in splits.items()} == {"rollout": 24, "qc": 8, "dev": 8}
    check_disjoint(splits)
    shapes = {s for s, _ in train_scale.SIZES}
    assert all(Image.open(p).size in shapes for d in splits.values() for p in d.paths)
    extra = ("--device cpu --img-size 64 --num-classes 5 --updates 2 --rollout-images 4 --checkpoint-every 1 "
             "--qc-shards 2 --data-workers 1 --gate-minibatch 16 --controller-minibatch 4 --critic-minibatch 16 "
             "--actor-epochs 1 --critic-epochs 1")
    out = tmp_path / "result.json"
    argv = [sys.executable, "-m", "benchmarks.train_scale", "run", "--root", str(root), "--run", str(run),
            "--model", "vit_tiny_patch16_224", "--extra", extra, "--out", str(out)]
    subprocess.run(argv, check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1])  # as documented
    res = json.loads(out.read_text())
    assert res["command"] == "python -m benchmarks.train_scale " + " ".join(argv[3:])
    assert res["updates"] == 2 and len(res["segments"]) == 1 and res["segments"][0]["updates"] == [1, 2]
    assert res["rollout_files"] == 24 and res["wall_min"] > 0 and 0 <= res["data_wait_fraction"] < 1
    assert res["first_update_s"] > 0 and res["peak_host_gb"] > 0 and res["s_per_update"] > 0


def test_serving_latency_summary_by_hand():
    from benchmarks.serving_latency import summary

    times = [float(t) for t in range(1, 101)]  # 1 .. 100 ms, 100 requests of 4 images
    row = summary(times[::-1], 4)
    # median of 1..100 is 50.5; p99: the element at rank round(0.99 * 99) = 98 (0-based) is 99;
    # 400 images in 5,050 ms
    assert row == {"p50_ms": 50.5, "p99_ms": 99.0, "max_ms": 100.0, "images_per_s": round(400 / 5.05, 1)}


def test_serving_latency_stream_takes_the_pool_in_turn_and_profiles_on_cpu():
    import torch

    from benchmarks.serving_latency import kernel_profile, stream

    seen = []
    pool = torch.arange(10.0)[:, None]  # 10 one-number "images"; batches of 4 use the first 8

    def fn(x):
        seen.append(x[:, 0].tolist())
        return x

    assert len(stream(fn, pool, 4, 1, 3)) == 3
    assert seen == [[4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]  # requests 1, 2, 3 of the stream
    prof = kernel_profile(lambda x: x * 2, pool, 4, 0, count=2)
    assert prof["kernels_per_request"] == 0 and prof["kernel_ms_per_request"] == 0  # no device kernels on a CPU


def test_serving_latency_mixed_stream_by_hand():
    """A mixed stream: request i takes ``sizes[i % len]`` images from successive windows of the largest
    size; its images/s counts each request's own images; the sizes cycle holds every size."""
    import torch

    from benchmarks.serving_latency import mixed_sizes, stream, summary

    seen = []
    pool = torch.arange(10.0)[:, None]  # windows of 3: rows 0-2, 3-5, 6-8

    def fn(x):
        seen.append(x[:, 0].tolist())
        return x

    assert len(stream(fn, pool, [1, 3, 2], 1, 4)) == 4
    assert seen == [[3, 4, 5], [6, 7], [0], [3, 4, 5]]  # requests 1-4: sizes 3, 2, 1, 3
    # requests 2 and 3 (sizes 2 and 1) in 10 and 20 ms: 3 images in 30 ms
    assert summary([10.0, 20.0], [1, 3, 2], first=2)["images_per_s"] == 100.0
    sizes = mixed_sizes([1, 2, 4, 8, 16])
    assert len(sizes) == 64 and set(sizes) == {1, 2, 4, 8, 16} and sizes == mixed_sizes([1, 2, 4, 8, 16])
    assert sizes[:10] != sorted(sizes[:10])  # (shuffled)


def test_serving_latency_interleaves_the_executors_and_keeps_the_model_unwrapped():
    """``measure``: every executor's rounds take turns (the request indices show the order), the
    DORA rows come from a wrapped copy, and the model the native rows ran stays native."""
    import argparse

    import torch

    import timm_dora
    from benchmarks import serving_latency
    from helpers import kind_actor, make_model

    model = make_model("deit_tiny_patch16_224", img_size=64).eval()
    actor = kind_actor(model, "forced")
    pool = torch.randn(6, 3, 64, 64)
    order = []
    real = serving_latency.stream

    def logged(fn, pool, batch, first, count):
        order.append((getattr(fn, "_dora", None) is not None, first, count))
        return real(fn, pool, batch, first, count)

    args = argparse.Namespace(warmup_requests=1, requests=4, rounds=2, kernels=False, sequence=False)
    serving_latency.stream = logged
    try:
        rows = serving_latency.measure(["native_eager", "dora_default"], model, actor, pool, 2, args)
    finally:
        serving_latency.stream = real
    # warm-ups (request 0, one each), then two rounds of two requests each, native then DORA
    assert order == [(False, 0, 1), (True, 0, 1), (False, 1, 2), (True, 1, 2), (False, 3, 2), (True, 3, 2)]
    assert set(rows) == {"native_eager", "dora_default"} and rows["dora_default"]["plan_misses"] == 0
    assert rows["dora_default"]["executor"] == "eager" and not timm_dora.is_wrapped(model)
    # with ``served``, one wrapped copy serves every request size and stays wrapped for the caller
    served = {}
    first = serving_latency.measure(["dora_default"], model, actor, pool, 2, args, served)
    kept = served["dora_default"]
    second = serving_latency.measure(["dora_default"], model, actor, pool, 3, args, served)
    assert served == {"dora_default": kept} and timm_dora.is_wrapped(kept) and not timm_dora.is_wrapped(model)
    assert first["dora_default"]["plan_misses"] == second["dora_default"]["plan_misses"] == 0
    # a mixed stream of sizes 2, 1, 3 with the same copy: 4 requests after one of warm-up
    mixed = serving_latency.measure(["dora_default"], model, actor, pool, [2, 1, 3], args, served)
    assert served == {"dora_default": kept} and mixed["dora_default"]["images_per_s"] > 0
    timm_dora.unwrap(kept)


def test_serving_latency_reports_an_executor_that_fails_and_measures_the_others(monkeypatch, capsys):
    """An executor that raises in the timed rounds gets its ``error``; the others keep their rows;
    ``--rounds`` outside 1..``--requests`` is refused with a message."""
    import argparse

    import pytest
    import torch

    from benchmarks import serving_latency

    calls = {"n": 0}

    def flaky(x):
        calls["n"] += 1
        if calls["n"] > 2:  # the warm-up and the first round's request run, then it fails
            raise RuntimeError("device lost\nsecond line")
        return x

    monkeypatch.setattr(serving_latency, "executor",
                        lambda name, model, actor, served=None: ((lambda x: x) if name == "native_eager" else flaky, None))
    args = argparse.Namespace(warmup_requests=1, requests=3, rounds=3, kernels=False, sequence=False)
    rows = serving_latency.measure(["native_eager", "native_compiled"], None, None, torch.zeros(4, 1), 1, args)
    assert rows["native_compiled"] == {"error": "RuntimeError: device lost"}
    assert rows["native_eager"]["images_per_s"] > 0 and set(rows) == {"native_eager", "native_compiled"}
    with pytest.raises(SystemExit):
        serving_latency.main(["--rounds", "0", "--configs", "deit_base_forced"])
    assert "--rounds must be between 1 and --requests (2000), got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving_latency.main(["--mixed", "--warmup-requests", "10", "--configs", "deit_base_forced"])
    assert "--mixed needs --warmup-requests of at least 64 (one cycle of its sizes), got 10" in capsys.readouterr().err


def test_default_speed_reads_the_best_oracle_target_by_hand():
    from benchmarks.default_speed import targets

    res = {"vit_tiny_published": {"dora_default_ips": 90.0, "oracle_compiled_ips": 80.0,
                                  "oracle_compiled_gemm_embed_ips": 100.0},
           "deit_tiny_published": {"dora_default_ips": 89.0, "oracle_compiled_ips": 100.0}}
    out = targets(res)
    assert out["vit_tiny_published_default_over_best_oracle"] == {"ratio": 0.9, "target": 0.9, "met": True}
    assert out["deit_tiny_published_default_over_best_oracle"] == {"ratio": 0.89, "target": 0.9, "met": False}
    assert "deit_base_forced_369_default_over_best_oracle" not in out


def test_serving_latency_targets_by_hand():
    from benchmarks.serving_latency import targets

    row = lambda ips, p50, p99: {"images_per_s": ips, "p50_ms": p50, "p99_ms": p99}
    res = {"deit_base_forced": {"16": {"native_reduce_overhead": row(100.0, 1.0, 1.1), "dora_default": row(101.0, 1.0, 1.6)}},
           "vit_tiny_published": {"8": {"native_reduce_overhead": row(100.0, 1.0, 1.0), "dora_default": row(90.0, 2.0, 3.0)},
                                  "16": {"native_reduce_overhead": row(100.0, 1.0, 1.0), "dora_default": row(95.0, 2.0, 2.0)},
                                  "mixed": {"native_reduce_overhead": row(1.0, 1.0, 1.0), "dora_default": row(1.0, 1.0, 9.0)}}}
    out = targets(res)
    assert set(out["vit_tiny_published"]) == {"8", "16"}  # (the mixed stream is not one of the sizes)
    assert out["deit_base_forced"]["16"] == {"over_reduce_overhead": {"ratio": 1.01, "target": 1.0, "met": True},
                                             "p99_over_p50": {"ratio": 1.6, "target": 1.5, "met": False}}
    assert out["vit_tiny_published"]["8"]["over_reduce_overhead"] == {"ratio": 0.9, "target": 0.9, "met": True}
    assert out["vit_tiny_published"]["8"]["p99_over_p50"]["met"]  # exactly 1.5
    assert out["vit_tiny_published"]["16"]["over_reduce_overhead"] == {"ratio": 0.95, "target": 1.0, "met": False}


def test_batch_scale_compares_arms_at_equal_images_by_hand(tmp_path, monkeypatch):
    """``batch_scale compare``: runs ``ARM_sSEED`` grouped by arm, each window the mean of a run's
    updates whose rollout images seen fall inside it, then mean and sd over the arm's runs. Two
    runs of 100-image updates against one of 200: at equal images, not equal updates."""
    from benchmarks import batch_scale

    keys = ["update", *batch_scale.CURVE_KEYS]

    def run(images, scale, values):  # compression per update; qc_disagreement logged at even updates only
        rows = [[u, c, *([None] * (len(keys) - 2))] for u, c in enumerate(values, 1)]
        for r in rows:
            r[keys.index("qc_disagreement")] = 0.1 * r[0] if r[0] % 2 == 0 else None
        return {"seed": 0, "batch_scale": scale, "rollout_images": images, "keys": keys, "rows": rows}

    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({"runs": {"paper_s0": run(100, 1, [1, 2, 3, 4]), "paper_s1": run(100, 1, [3, 4, 5, 6]),
                                           "scaled_s0": run(200, 2, [10, 20])}}))
    out = tmp_path / "compare.json"
    monkeypatch.setattr(sys, "argv", ["batch_scale", "compare", "--curves", str(curves), "--window", "200", "--images", "400",
                                      "--out", str(out)])
    batch_scale.main()
    arms = json.loads(out.read_text())["arms"]
    paper, scaled = arms["paper"]["windows"], arms["scaled"]["windows"]
    assert [w["images"] for w in paper] == [[0, 200], [200, 400]]
    # paper_s0: updates 1-2 (100, 200 images) -> 1.5, updates 3-4 -> 3.5; paper_s1: 3.5, 5.5
    assert paper[0]["compression"] == {"mean": 2.5, "sd": pytest.approx(math.sqrt(2)), "runs": 2, "values": [1.5, 3.5]}
    assert paper[1]["compression"]["mean"] == 4.5
    assert paper[0]["qc_disagreement"]["mean"] == pytest.approx(0.2)  # only update 2 logged it
    assert scaled[0]["compression"] == {"mean": 10, "sd": None, "runs": 1, "values": [10]}
    assert scaled[1]["compression"]["mean"] == 20
    assert arms["scaled"]["batch_scale"] == [2] and arms["paper"]["runs"] == 2
    # against the first arm: one scaled seed (10) against paper's two (1.5, 3.5)
    assert scaled[0]["vs"]["compression"]["diff"] == 7.5 and scaled[0]["vs"]["compression"]["low"] == 6.5
    assert scaled[0]["vs"]["compression"]["high"] == 8.5 and "vs" not in paper[0]
    gz = tmp_path / "curves.json.gz"  # (committed curves are gzipped)
    gz.write_bytes(gzip.compress(curves.read_bytes()))
    monkeypatch.setattr(sys, "argv", ["batch_scale", "compare", "--curves", str(gz), "--by", "updates", "--window", "2",
                                      "--images", "4", "--out", str(out)])
    batch_scale.main()
    arms = json.loads(out.read_text())["arms"]
    assert [w["updates"] for w in arms["paper"]["windows"]] == [[0, 2], [2, 4]]
    assert arms["scaled"]["windows"][0]["compression"]["mean"] == 15  # its updates 1-2, at equal updates


def test_serving_latency_kernel_families_by_hand():
    from benchmarks.serving_latency import family

    assert family("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert family("_varlen_fwd") == "attention"
    assert family("triton_per_fused_native_layer_norm_0") == "norm"
    assert family("_add_layer_norm_fwd") == "norm"
    assert family("Memset (Device)") == "copy"
    assert family("triton_poi_fused_add_mul_0") == "triton" and family("_compact") == "triton"
    assert family("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_batch_scale_packs_runs_without_their_state(tmp_path, monkeypatch):
    import io
    import tarfile

    from benchmarks import batch_scale

    run = tmp_path / "runs" / "paper_s0"
    (run / "checkpoints" / "u00002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"update": 1}\n')
    (run / "checkpoints" / "u00002" / "model.safetensors").write_bytes(bytes(range(256)) * 4000)
    (run / "state.pt").write_bytes(b"x" * 1000)
    (run / "pid").write_text("123")
    monkeypatch.setattr(sys, "argv", ["batch_scale", "pack", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
                                      "--part-mb", "0.001"])
    batch_scale.main()
    parts = sorted((tmp_path / "out").glob("runs.tgz.part*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 0.001 * 2**20 for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:gz") as tar:
        names = set(tar.getnames())
        blob = tar.extractfile("paper_s0/checkpoints/u00002/model.safetensors").read()
    assert names == {"paper_s0/metrics.jsonl", "paper_s0/checkpoints/u00002/model.safetensors"}
    assert blob == bytes(range(256)) * 4000


def test_train_scale_ddp_scaling_by_hand_and_into_a_result_file(tmp_path, monkeypatch):
    """``train_scale ddp``: ``scaling`` is each variant's rollout images per second over one GPU's
    (by hand: 512 images in 0.6 s against 256 in 0.45 s is 1.5), the first variant's the result's;
    ``--into`` sets the model's entry of a result file's ``ddp`` and keeps the rest of the file."""
    from benchmarks import train_scale

    timed = {"one_gpu": (256, 0.45), "2_gpus_scaled": (512, 0.6), "2_gpus_paper": (256, 0.375)}
    envs = {}

    def fake_run(args, name, cmd, env, run_dir):
        envs[name] = env
        return {"images_per_update": timed[name][0], "s_per_update": timed[name][1], "command": " ".join(cmd)}

    monkeypatch.setattr(train_scale, "_timed_run", fake_run)
    into = tmp_path / "result.json"
    into.write_text(json.dumps({"wall_min": 9.8, "ddp": {"vit_tiny": {"scaling": 1.6}, "note": "kept"}}))
    monkeypatch.setattr(sys, "argv", ["train_scale", "ddp", "--root", str(tmp_path), "--model", "deit_base_patch16_224",
                                      "--variants", "scaled:NCCL_MAX_CTAS=2 --batch-scale 2", "paper:", "--out", str(tmp_path / "d.json"),
                                      "--into", str(into)])
    train_scale.main()
    doc = json.loads(into.read_text())
    assert doc["wall_min"] == 9.8 and doc["ddp"]["vit_tiny"] == {"scaling": 1.6} and doc["ddp"]["note"] == "kept"
    entry = doc["ddp"]["deit_base"]
    assert entry["scaling"] == 1.5 and entry["2_gpus_paper"]["scaling"] == 1.2
    assert (entry["s_per_update"], entry["one_gpu_s_per_update"], entry["variant"]) == (
        0.6, 0.45, "scaled:NCCL_MAX_CTAS=2 --batch-scale 2")
    # an ENV=VALUE word sets the variant's environment, not a flag; one GPU runs on GPU 0
    assert entry["2_gpus_scaled"]["command"].endswith("--checkpoint-every 40 --batch-scale 2")
    assert envs["2_gpus_scaled"]["NCCL_MAX_CTAS"] == "2" and entry["2_gpus_scaled"]["env"] == {"NCCL_MAX_CTAS": "2"}
    assert "NCCL_MAX_CTAS" not in envs["2_gpus_paper"] and envs["one_gpu"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert envs["2_gpus_paper"]["NCCL_NVLS_ENABLE"] == "0" and "env" not in entry["2_gpus_paper"]
    assert entry == json.loads((tmp_path / "d.json").read_text())


def test_train_scale_busy_time_counts_overlapping_kernels_once():
    from benchmarks.train_scale import busy_ms

    # [0, 10) and [5, 20) overlap (20 us), [30, 40) alone (10), [32, 35) inside it (0): 30 us
    assert busy_ms([(30, 40), (0, 10), (5, 20), (32, 35)]) == 0.03
    assert busy_ms([]) == 0.0


def test_train_scale_updates_profiles_consecutive_updates_on_cpu(tmp_path, monkeypatch):
    """``updates`` (CPU, one process, a tiny recipe): the profiled updates' phases and host calls
    per process, and the trace; no GPU fields but zeros."""
    import argparse

    from PIL import Image

    import torch
    from benchmarks import train_scale

    sources = tmp_path / "sources"
    sources.mkdir()
    for c in range(3):
        Image.fromarray((torch.rand(48, 64, 3, generator=torch.Generator().manual_seed(c)) * 255).to(torch.uint8).numpy()
                        ).save(sources / f"n0000000{c}.jpg")
    root = tmp_path / "set"
    train_scale.make(argparse.Namespace(sources=str(sources), root=str(root), rollout=8, qc=4, dev=4, seed=0, workers=1))
    extra = ("--device cpu --img-size 64 --num-classes 3 --updates 4 --rollout-images 4 --checkpoint-every 4 "
             "--qc-shards 1 --data-workers 0 --gate-minibatch 16 --controller-minibatch 4 --critic-minibatch 16 "
             "--actor-epochs 1 --critic-epochs 1")
    out = tmp_path / "updates.json"
    monkeypatch.setattr(sys, "argv", ["train_scale", "updates", "--root", str(root), "--model", "vit_tiny_patch16_224",
                                      "--extra", extra, "--warmup", "1", "--updates", "2", "--trace-dir", str(tmp_path / "t"),
                                      "--out", str(out)])
    train_scale.main()
    res = json.loads(out.read_text())
    assert res["processes"] == 1 and res["updates"] == 2 and res["device"] == "cpu"
    (r,) = res["ranks"]
    assert r["rank"] == 0 and len(r["update_s"]) == 2 and r["wall_ms"] >= 1e3 * sum(r["update_s"]) / 2 * 0.99
    assert {"rollout", "actor_update"} <= set(r["phases"]) and r["kernels"] == 0 and r["gpu_busy_ms"] == 0
    assert r["allreduce_calls"] == 0 and r["graph_launch_calls"] == 0  # (one process, no CUDA graphs)
    events = json.loads(gzip.decompress((tmp_path / "t" / "trace_rank0.json.gz").read_bytes()))["traceEvents"]
    # each phase's end marked in the trace (PhaseClock), once per profiled update
    ends = [e["name"] for e in events if e.get("name", "").startswith("phase ")]
    assert ends.count("phase rollout") == 2 and ends.count("phase actor_update") == 2


def test_train_scale_phases_attribute_gpu_work_to_the_phase_that_launched_it(tmp_path, monkeypatch):
    """``phases``: a hand-made trace, two phases ending at 100 and 250 us (the markers' thread 1);
    a kernel launched at 90 but run at 120-150 belongs to the first, as the launch's host time on
    thread 1; a graph launch on thread 2 at 200 (its kernels on stream 9 and NCCL's overlapping)
    to the second."""
    from benchmarks import train_scale

    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = [x("user_annotation", "phase rollout", 100, 0), x("user_annotation", "phase actor_update", 250, 0),
              x("cuda_runtime", "cudaLaunchKernel", 90, 4, correlation=1), x("kernel", "gemm", 120, 30, stream=7, correlation=1),
              x("cuda_runtime", "cudaGraphLaunch", 200, 10, tid=2, correlation=2),
              x("kernel", "step", 210, 40, stream=9, correlation=2), x("kernel", "ncclAllReduce", 230, 40, stream=9, correlation=2),
              x("kernel", "orphan", 300, 5, stream=7, correlation=99)]  # (no launch in the trace: left out)
    rows = train_scale.trace_phases(events)
    assert rows == [
        {"phase": "rollout", "host_ms": None, "stream_ms": {"7": 0.03}, "main": {"cudaLaunchKernel": 0.004}, "other": {},
         "gpu_busy_ms": 0.03, "kernels": 1},
        {"phase": "actor_update", "host_ms": 0.15, "stream_ms": {"9": 0.04, "nccl": 0.04}, "main": {},
         "other": {"cudaGraphLaunch": 0.01}, "gpu_busy_ms": 0.06, "kernels": 2}]
    with pytest.raises(ValueError, match="no phase markers"):
        train_scale.trace_phases(events[2:])
    trace = tmp_path / "t.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    monkeypatch.setattr(sys, "argv", ["train_scale", "phases", str(trace), "--out", str(tmp_path / "p.json")])
    train_scale.main()
    assert json.loads((tmp_path / "p.json").read_text()) == {str(trace): rows}


def test_batch_scale_seed_bootstrap_by_hand():
    """One seed per arm: every resample is the same, the interval a point; arms of constant runs
    likewise; two seeds: the extremes of the resampled means bound the interval."""
    from benchmarks.batch_scale import seed_bootstrap

    assert seed_bootstrap([1.0], [3.0]) == {"diff": 2.0, "low": 2.0, "high": 2.0}
    assert seed_bootstrap([1.0, 1.0, 1.0], [1.5, 1.5]) == {"diff": 0.5, "low": 0.5, "high": 0.5}
    # b in {0, 1}: resampled means 0, 0.5, 1 (probabilities 1/4, 1/2, 1/4), a fixed at 0
    r = seed_bootstrap([0.0], [0.0, 1.0])
    assert r["diff"] == 0.5 and r["low"] == 0.0 and r["high"] == 1.0
