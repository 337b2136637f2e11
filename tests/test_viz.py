"""timm_dora.viz: plot data equals the model's outputs, pictures are valid PNG/SVG, `timm-dora viz` runs."""
import json
from pathlib import Path
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from PIL import Image

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import timm_dora  # noqa: E402
from timm_dora import viz  # noqa: E402
from timm_dora.cli import main  # noqa: E402

from helpers import images, make_model  # noqa: E402

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# deit_tiny at 64 px: a 4x4 grid of 16x16 patches. Visual columns (among the tokens still there).
PLAN = {
    1: (torch.tensor([0, 0, 1]), torch.tensor([0, 5, 3])),
    4: (torch.tensor([0, 0, 0]), torch.tensor([2, 3, 13])),
    7: (torch.tensor([1]), torch.tensor([0])),
}


def expected_removed(plan, batch, n0):
    """Original grid indices removed per image and block, by replaying the columns on lists."""
    alive = [list(range(n0)) for _ in range(batch)]
    out = {i: {} for i in range(batch)}
    for l in sorted(plan):
        img, col = plan[l]
        for i in range(batch):
            cols = sorted(col[img == i].tolist())
            if cols:
                gone = [alive[i][c] for c in cols]
                out[i][l] = sorted(gone)
                alive[i] = [p for p in alive[i] if p not in gone]
    return out


def check_png(path):
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()


def check_svg(path):
    assert path.is_file()
    assert ET.parse(path).getroot().tag.endswith("svg")


def by_gid(fig, gid):
    found = fig.findobj(lambda a: a.get_gid() == gid)
    assert len(found) == 1, (gid, found)
    return found[0]


@pytest.fixture(scope="module")
def pruned():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    timm_dora.wrap(model, policy=timm_dora.ReplayPolicy(PLAN))
    x = images(model, 3)
    model(x)
    return model, x, model.dora_stats


def test_trajectory_masks_titles_and_pixels_follow_the_plan(pruned, tmp_path):
    model, x, stats = pruned
    want = expected_removed(PLAN, 3, 16)
    fig, datas = viz.trajectory_grid(model, x, names=["a", "b", "c"], title="replay")
    assert viz.patch_geometry(model) == {"patch_size": (16, 16), "grid_size": (4, 4), "img_size": (64, 64)}
    for i, d in enumerate(datas):
        assert d["blocks"] == sorted(want[i])  # gate opened exactly where the plan removes
        assert d["removed_patches"] == want[i]
        gone = set()
        for j, l in enumerate(d["blocks"]):
            gone |= set(want[i][l])
            mask = np.zeros(16, dtype=bool)
            mask[sorted(gone)] = True
            assert np.array_equal(d["masks"][j], mask.reshape(4, 4))
            assert d["kept"][j] == 16 - len(gone) == int(stats.tokens[i, l])
            assert d["removed"][j] == len(want[i][l])
        assert d["gflops"] == float(stats.gflops[i])
        assert d["native_gflops"] == timm_dora.native_gflops(model)
        # the input panel: the normalised tensor denormalised with the model's (ImageNet) mean/std
        ref = ((x[i] * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None])
               .clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        assert np.array_equal(d["image"], ref)
        assert np.array_equal(by_gid(fig, f"trajectory-{i}-input").get_array(), ref)
        # drawn panels: exactly the removed patches are greyed
        for j, l in enumerate(d["blocks"]):
            art = by_gid(fig, f"trajectory-{i}-{l}")
            drawn = np.asarray(art.get_array())
            changed = (drawn != ref).any(-1).reshape(4, 16, 4, 16).any(axis=(1, 3))
            assert np.array_equal(changed, d["masks"][j])
            assert art.axes.get_title() == f"block {l}: {d['kept'][j]} kept"
    assert datas[2]["blocks"] == [] and by_gid(fig, "trajectory-2-input").axes.get_title() == "16 kept (gate never opened)"
    paths = viz.save(fig, tmp_path / "traj")
    check_png(paths[0])
    check_svg(paths[1])


def test_trajectory_images_given_as_pil_or_uint8(pruned):
    model, _, stats = pruned
    arr = (np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)
    d = viz.trajectory_data(stats, 0, model=model, image=Image.fromarray(arr))
    assert np.array_equal(d["image"], arr)
    assert np.array_equal(viz.trajectory_data(stats, 0, model=model, image=arr)["image"], arr)
    with pytest.raises(ValueError, match="model sees 64x64"):
        viz.trajectory_data(stats, 0, model=model, image=np.zeros((70, 64, 3), np.uint8))
    d = viz.trajectory_data(stats, 1, patch_size=16, grid_size=4)  # geometry without the model, no image
    assert d["image"] is None and d["blocks"] == [1, 7] and d["native_gflops"] is None
    fig = viz.plot_trajectory(d)
    assert by_gid(fig, "trajectory-0-7").axes.get_title() == "block 7: 14 kept"


def test_policy_summary_equals_hand_counts(pruned, tmp_path):
    model, x, stats = pruned
    # a second batch with another plan: the summary runs over a dataset given as a list of stats
    plan2 = {4: (torch.tensor([0, 0, 1]), torch.tensor([1, 2, 5])), 11: (torch.tensor([1]), torch.tensor([0]))}
    timm_dora.set_policy(model, timm_dora.ReplayPolicy(plan2))
    model(images(model, 2, seed=5))
    stats2 = model.dora_stats
    timm_dora.set_policy(model, timm_dora.ReplayPolicy(PLAN))
    native = timm_dora.native_gflops(model)
    data = viz.policy_data([stats, stats2], native)
    # 5 images; removed per image and block, by hand from the two plans
    k = np.zeros((5, 12), dtype=int)
    k[0, 1], k[1, 1], k[0, 4], k[1, 7] = 2, 1, 3, 1
    k[3, 4], k[4, 4], k[4, 11] = 2, 1, 1
    assert data["num_images"] == 5 and data["depth"] == 12
    assert np.allclose(data["rate"], (k > 0).mean(0))
    assert data["active"].tolist() == (k > 0).sum(0).tolist()
    assert data["budget_min"][1] == 1 and data["budget_max"][1] == 2 and data["budget_mean"][1] == 1.5
    assert data["budget_min"][4] == 1 and data["budget_max"][4] == 3 and data["budget_mean"][4] == 2.0
    assert data["budget_mean"][7] == 1 and data["budget_mean"][11] == 1
    assert np.isnan(data["budget_mean"][0]) and np.isnan(data["budget_min"][5])
    assert data["collapsed"].tolist() == [l in (7, 11) for l in range(12)]
    g = torch.cat([stats.gflops, stats2.gflops]).double().numpy()
    assert np.allclose(data["reduction"], 100 * (1 - g / native))
    assert data["reduction_mean"] == pytest.approx(100 * (1 - g.mean() / native))
    assert data["hist_counts"].sum() == 5
    # the same from already concatenated tensors
    cat = {key: torch.cat([getattr(stats, key), getattr(stats2, key)]) for key in ("gate", "removed", "tokens", "gflops")}
    assert np.allclose(viz.policy_data(cat, native)["rate"], data["rate"])

    fig = viz.plot_policy(data, "replay")
    assert [by_gid(fig, f"rate-{l}").get_height() for l in range(12)] == pytest.approx(list(100 * (k > 0).mean(0)))
    mean_line = by_gid(fig, "budget_mean")
    assert mean_line.get_xdata().tolist() == [1, 4] and mean_line.get_ydata().tolist() == [1.5, 2.0]
    assert by_gid(fig, "budget_collapsed").get_xdata().tolist() == [7, 11]
    assert by_gid(fig, "reduction_mean").get_xdata()[0] == pytest.approx(data["reduction_mean"])
    for p in viz.save(fig, tmp_path / "policy"):
        (check_png if p.suffix == ".png" else check_svg)(p)


def write_log(path, updates=40, cadence=4):
    rows = []
    a = 30.0
    for u in range(1, updates + 1):
        r = {"update": u, "a_u": a, "compression": 0.5 - u / 200, "return_mean": -10.0 + u / 4, "gflops": 2.0}
        if u % cadence == 0:
            d = ((u * 7) % 5) / 100 - 0.01
            r.update(d_u=d, qc_shard=(u // cadence - 1) % 8, a_next=a + 5)
            a += 5
        rows.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_training_dynamics_plot_the_log_values(tmp_path):
    rows = write_log(tmp_path / "metrics.jsonl")
    data = viz.training_data(viz.read_metrics(tmp_path / "metrics.jsonl"), target=0.015)
    checks = [r for r in rows if "d_u" in r]
    pp = [100 * r["d_u"] for r in checks]
    recent = [np.mean(pp[max(0, i - 7): i + 1]) for i in range(len(pp))]  # 10 checks: the window slides
    assert data["drop_mean_pp"] == pytest.approx(recent)
    assert data["target_pp"] == pytest.approx(1.5)
    fig = viz.plot_training(data, "test")
    a_line = by_gid(fig, "a_u")
    assert a_line.get_xdata().tolist() == [r["update"] for r in rows]
    assert a_line.get_ydata().tolist() == [r["a_u"] for r in rows]
    assert by_gid(fig, "drop").get_ydata().tolist() == pytest.approx(pp)
    assert by_gid(fig, "drop_mean").get_ydata().tolist() == pytest.approx(recent)
    assert by_gid(fig, "drop_mean").get_xdata().tolist() == [r["update"] for r in checks]
    assert list(by_gid(fig, "target").get_ydata()) == [1.5, 1.5]
    assert by_gid(fig, "compression").get_ydata().tolist() == [r["compression"] for r in rows]
    assert by_gid(fig, "return_mean").get_ydata().tolist() == [r["return_mean"] for r in rows]
    # a log without feedback checks still draws
    assert viz.plot_training(viz.training_data(rows[:3])) is not None


def test_cli_viz_training(tmp_path):
    rows = write_log(tmp_path / "metrics.jsonl")
    (tmp_path / "config.json").write_text(json.dumps({"target_drop": 0.005}))  # the run's own target
    out = tmp_path / "pics"
    assert main(["viz", "training", "--metrics", str(tmp_path / "metrics.jsonl"), "--out", str(out)]) == 0
    check_png(out / "training.png")
    check_svg(out / "training.svg")
    numbers = json.loads((out / "training.json").read_text())
    assert numbers["a_u"] == [r["a_u"] for r in rows] and numbers["target_pp"] == pytest.approx(0.5)
    assert main(["viz", "training", "--metrics", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 1


def test_tradeoff_from_bench_and_eval_json(tmp_path):
    bench = {"device": "GPU X", "rows": [
        {"model": "m", "config": "native", "gflops": 2.5, "images_per_s": 1000.0},
        {"model": "m", "config": "dora", "gflops": 1.5, "images_per_s": 1500.0},
        {"model": "m", "config": "tome", "gflops": 1.6, "images_per_s": 1400.0},
    ]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    data = viz.tradeoff_data(viz.read_results(tmp_path / "bench.json"))
    assert data["has_top1"] == {"m": False} and data["devices"] == ["GPU X"]
    fig = viz.plot_tradeoff(data)
    art = by_gid(fig, "m|dora|throughput_vs_gflops")
    assert (art.get_xdata()[0], art.get_ydata()[0]) == (1.5, 1500.0)
    assert "no top-1" in art.axes.get_ylabel()

    # timm-dora eval / bench format: top-level model, rows with method and a config dict
    evals = {"model": "m", "device": "cpu", "rows": [
        {"method": "native", "config": {}, "top1": 75.0, "gflops": 2.5},
        {"method": "dora", "config": {"actor": "a"}, "top1": 74.2, "gflops": 1.5},
        {"method": "tome", "config": {"r": 8}, "top1": 73.0, "gflops": 1.6},
        {"method": "tome", "config": {"r": 12}, "top1": 71.0, "gflops": 1.2}]}
    benches = {"model": "m", "device": "GPU X", "rows": [
        {"method": "native", "config": {}, "gflops": 2.5, "images_per_s": 1000.0},
        {"method": "dora", "config": {"actor": "a"}, "gflops": 1.5, "images_per_s": 1500.0},
        {"method": "tome", "config": {"r": 8}, "gflops": 1.6, "images_per_s": 1400.0}]}
    (tmp_path / "eval.json").write_text(json.dumps(evals))
    (tmp_path / "bench2.json").write_text(json.dumps(benches))
    files = [str(tmp_path / "eval.json"), str(tmp_path / "bench2.json")]
    out = tmp_path / "pics"
    assert main(["viz", "tradeoff", "--results", *files, "--out", str(out)]) == 0
    check_png(out / "tradeoff.png")
    check_svg(out / "tradeoff.svg")
    merged = viz.tradeoff_data(viz.read_results(files))
    assert merged["models"] == ["m"] and merged["has_top1"] == {"m": True}
    assert merged["labels"] == ["native", "dora", "tome [r=8]", "tome [r=12]"]
    fig = viz.plot_tradeoff(merged)
    g, t = by_gid(fig, "m|dora|gflops"), by_gid(fig, "m|dora|throughput")
    assert (g.get_xdata()[0], g.get_ydata()[0]) == (1.5, 74.2)
    assert (t.get_xdata()[0], t.get_ydata()[0]) == (1500.0, 74.2)
    assert g.get_marker() == "*" and by_gid(fig, "m|tome [r=8]|gflops").get_marker() != "*"
    t8 = by_gid(fig, "m|tome [r=8]|throughput")
    assert (t8.get_xdata()[0], t8.get_ydata()[0]) == (1400.0, 73.0)
    assert not fig.findobj(lambda a: a.get_gid() == "m|tome [r=12]|throughput")  # no throughput measured
    assert by_gid(fig, "m|tome [r=12]|gflops").get_ydata()[0] == 71.0


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("viz_cli")
    from safetensors.torch import save_file

    model = make_model("deit_tiny_patch16_224", img_size=64)
    save_file(model.state_dict(), str(root / "w.safetensors"))
    torch.manual_seed(3)
    timm_dora.Actor.for_model(model).save_pretrained(root / "actor", backbone=model)
    g = torch.Generator().manual_seed(0)
    rows = ["path,label,synset,set,split"]
    for i in range(6):
        arr = (torch.rand(70, 80, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).save(root / f"img{i}.png")
        rows.append(f"img{i}.png,{i % 3},n{i % 3:08d},x,{'dev' if i < 4 else 'qc'}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


MODEL_ARGS = ["--model", "deit_tiny_patch16_224", "--img-size", "64", "--num-classes", "10"]


def test_cli_viz_trajectory(tiny_files, tmp_path):
    root = tiny_files
    imgs = [str(root / "img0.png"), str(root / "img1.png")]
    args = ["viz", "trajectory", *MODEL_ARGS, "--weights", str(root / "w.safetensors"), "--images", *imgs]
    assert main(args + ["--actor", "random", "--out", str(tmp_path / "fresh")]) == 0
    check_png(tmp_path / "fresh" / "trajectory.png")
    check_svg(tmp_path / "fresh" / "trajectory.svg")
    numbers = json.loads((tmp_path / "fresh" / "trajectory.json").read_text())
    assert "untrained actor" in numbers["title"] and len(numbers["trajectories"]) == 2
    assert [t["name"] for t in numbers["trajectories"]] == ["img0", "img1"]
    assert main(args + ["--actor", str(root / "actor"), "--format", "png", "--out", str(tmp_path / "trained")]) == 0
    check_png(tmp_path / "trained" / "trajectory.png")
    assert not (tmp_path / "trained" / "trajectory.svg").exists()
    assert "trained actor actor" in json.loads((tmp_path / "trained" / "trajectory.json").read_text())["title"]


def test_cli_viz_policy(tiny_files, tmp_path):
    root = tiny_files
    assert main(["viz", "policy", *MODEL_ARGS, "--weights", str(root / "w.safetensors"), "--actor", str(root / "actor"),
                 "--data", str(root / "labels.csv"), "--split", "dev", "--batch", "3", "--out", str(tmp_path)]) == 0
    check_png(tmp_path / "policy.png")
    check_svg(tmp_path / "policy.svg")
    numbers = json.loads((tmp_path / "policy.json").read_text())
    assert numbers["num_images"] == 4 and len(numbers["rate"]) == 12


def test_viz_modules_import_matplotlib_only_inside_functions():
    import ast

    files = sorted(Path(viz.__file__).parent.glob("*.py"))
    assert len(files) >= 4
    for path in files:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(name.split(".")[0] == "matplotlib" for name in names), path.name


def _sweep_doc(model="m"):
    return {"model": model, "device": "GPU X", "split": "test", "n_images": 100,
            "native": {"top1": 80.0, "gflops": 2.5},
            "dora": {"seed": 0, "gflops": 1.8, "drop_pp": 0.5, "drop_se_pp": 0.3,
                     "seeds": [{"seed": 0, "gflops": 1.8, "drop_pp": 0.5, "drop_se_pp": 0.3},
                               {"seed": 1, "gflops": 1.9, "drop_pp": 1.2, "drop_se_pp": 0.4}]},
            "static": [{"family": "3,6,9", "rule": "cls_sim", "gflops": 2.2, "drop_pp": 0.8, "drop_se_pp": 0.2},
                       {"family": "3,6,9", "rule": "cls_sim", "gflops": 2.0, "drop_pp": 1.5, "drop_se_pp": 0.2}],
            "tome": [{"r": 4, "gflops": 2.1, "drop_pp": 0.2}, {"r": 5, "gflops": 2.0, "drop_pp": 0.3}],
            "random_selector": {"gflops": 1.7, "drop_pp": 4.0, "drop_se_pp": 0.6},
            "checkpoints": [{"gflops": 2.3, "drop_pp": 0.1, "drop_se_pp": 0.1}]}


def test_sweep_from_tradeoff_benchmark_json(tmp_path):
    data = viz.sweep_data(_sweep_doc())
    assert data["series"]["static cls_sim blocks 3,6,9"] == [(2.0, 1.5, 0.2), (2.2, 0.8, 0.2)]  # by GFLOPs
    assert data["series"]["ToMe r=4..5"] == [(2.0, 0.3, 0.0), (2.1, 0.2, 0.0)]
    assert data["series"]["DORA seeds"] == [(1.8, 0.5, 0.3), (1.9, 1.2, 0.4)]
    assert data["series"]["DORA checkpoints"] == [(2.3, 0.1, 0.1)]
    assert data["dora"] == (1.8, 0.5, 0.3) and data["random_selector"] == (1.7, 4.0, 0.6)
    assert data["native_gflops"] == 2.5
    fig = viz.plot_sweep([data])
    line = by_gid(fig, "m|static cls_sim blocks 3,6,9")
    assert list(line.get_xdata()) == [2.0, 2.2] and list(line.get_ydata()) == [1.5, 0.8]
    rnd = by_gid(fig, "m|random selector")
    assert (rnd.get_xdata()[0], rnd.get_ydata()[0]) == (1.7, 4.0)
    assert rnd.axes.get_ylim()[1] >= 4.5  # the random selector is on the panel
    def labelled(f, gid):  # the chosen seed's error bar: several artists share its gid
        return len(f.findobj(lambda a: a.get_gid() == gid))

    assert data["chosen_on"] == "dev" and labelled(fig, "m|DORA (seed chosen on dev)") > 0
    pooled = viz.sweep_data({**_sweep_doc(), "published_seed": {"seed": 0, "choice": "c.json"}})  # tradeoff.py --choice
    pooled_fig = viz.plot_sweep([pooled])
    assert pooled["chosen_on"] == "pool" and labelled(pooled_fig, "m|DORA (seed chosen on the pool)") > 0
    assert labelled(pooled_fig, "m|DORA (seed chosen on dev)") == 0

    trimmed = viz.sweep_data({**_sweep_doc(), "static": "left out: the same sweep as the main table"})
    assert not [k for k in trimmed["series"] if k.startswith("static")] and trimmed["dora"] == data["dora"]
    viz.plot_sweep([trimmed])  # a trimmed ablation table still plots (DORA, ToMe)

    with pytest.raises(ValueError, match="not a trade-off sweep"):
        viz.sweep_data({"native": {}})
    (tmp_path / "a.json").write_text(json.dumps(_sweep_doc("a")))
    (tmp_path / "b.json").write_text(json.dumps(_sweep_doc("b")))
    out = tmp_path / "pics"
    assert main(["viz", "tradeoff", "--results", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    check_png(out / "tradeoff.png")
    numbers = json.loads((out / "tradeoff.json").read_text())
    assert [d["model"] for d in numbers] == ["a", "b"] and numbers[0]["dora"] == [1.8, 0.5, 0.3]
    (tmp_path / "e.json").write_text(json.dumps({"model": "m", "rows": [{"method": "native", "top1": 1.0, "gflops": 2.0}]}))
    assert main(["viz", "tradeoff", "--results", str(tmp_path / "a.json"), str(tmp_path / "e.json"), "--out", str(out)]) == 1


def test_read_metrics_reads_gzip(tmp_path):
    import gzip

    rows = [{"update": 1, "a_u": 30.0}, {"update": 2, "a_u": 25.0}]
    with gzip.open(tmp_path / "metrics.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert viz.read_metrics(tmp_path / "metrics.jsonl.gz") == rows


def test_row_labels_are_cut_to_the_panel_after_underscores_first():
    from timm_dora.viz.plots import _row_label

    assert _row_label({"name": "ILSVRC2012_val_00012345_n01440764", "gflops": 1.4, "native_gflops": 2.5}) == \
        "ILSVRC2012_val_\n00012345_n01440764\n1.40 GFLOPs (-44.0 %)"
    assert _row_label({"name": "a" * 30, "index": 0, "gflops": 1.0}, chars=22) == "a" * 22 + "\n" + "a" * 8 + "\n1.00 GFLOPs"
    assert _row_label({"name": None, "index": 3, "gflops": 1.0}) == "image 3\n1.00 GFLOPs"
