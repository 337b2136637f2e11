"""``timm-dora eval`` and ``timm-dora bench`` end to end through the CLI on a tiny model and a
generated labels CSV of PNG images."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from timm_dora import Actor
from timm_dora.cli import main
from timm_dora.data import eval_transform, open_split, preload
from timm_dora.evaluate import load_model

from helpers import SMALL_FAMILIES, images, make_model

MODEL = "vit_tiny_patch16_224"
IMG = 64  # 16 patches: enough for the actor's budget grid
CLASSES = 10


def make_dataset(root: Path, n_test: int = 10, n_dev: int = 3) -> Path:
    """PNG images with labels 0..9 in a labels CSV (splits ``test`` and ``dev``)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n_test + n_dev):
        arr = (torch.rand(70 + i, 80, 3, generator=g) * 255).to(torch.uint8).numpy()
        name = f"img/{i:03d}.png"
        (root / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(root / name)
        rows.append([name, i % CLASSES, f"n{i:08d}", "gen", "test" if i < n_test else "dev"])
    path = root / "labels.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "synset", "set", "split"])
        w.writerows(rows)
    return path


def save_weights(model: torch.nn.Module, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    csv_path = make_dataset(root)
    model = make_model(MODEL, img_size=IMG, num_classes=CLASSES)
    weights = save_weights(model, root / "backbone.safetensors")
    torch.manual_seed(0)
    actor = Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(0.0)  # the gate opens for some images/blocks
    actor.save_pretrained(root / "actor", backbone=model)
    return root, csv_path, weights, root / "actor"


def _eval(root, csv_path, weights, *extra):
    out = root / f"res_{len(list(root.glob('res_*.json')))}.json"
    rc = main(["eval", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--data", str(csv_path), "--split", "test", "--device", "cpu", "--batch", "4", "--workers", "0",
               "--quiet", "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_eval_tome_json_and_native_top1(setup_files, capsys):
    root, csv_path, weights, _ = setup_files
    res = _eval(root, csv_path, weights, "--method", "tome", "--r", "2")
    for key in ("command", "device", "torch", "timm", "timm_dora", "dtype", "model", "weights", "data", "preprocessing", "rows"):
        assert key in res, key
    assert res["dtype"] == "float32" and res["data"] == {"spec": str(csv_path), "split": "test", "images": 10,
                                                         "skipped_unreadable": []}
    assert "--method tome" in res["command"] and "--r 2" in res["command"] and res["command"].startswith("timm-dora eval")
    native, tome = res["rows"]
    assert native["method"] == "native" and tome["method"] == "tome(r=2)"
    for row in (native, tome):
        for key in ("top1", "top5", "correct1", "correct5", "gflops", "gflops_min", "gflops_max", "images", "agreement"):
            assert key in row, key
        assert row["images"] == 10 and row["top5"] >= row["top1"]
    assert native["gflops_min"] == native["gflops_max"] == pytest.approx(native["gflops"])
    assert tome["gflops"] < native["gflops"]
    assert [b["budget_mean"] for b in tome["per_block"]][:3] == [2, 2, 2] and tome["per_block"][0]["gate_rate"] == 1.0
    # native top-1 equals a direct computation with the same weights and preprocessing
    model = load_model(MODEL, str(weights), img_size=IMG, num_classes=CLASSES)
    x, y = preload(open_split(csv_path, "test", eval_transform(model)))
    with torch.no_grad():
        direct = 100.0 * float((model(x).argmax(1) == y).float().mean())
    assert native["top1"] == pytest.approx(direct, abs=1e-9)
    assert native["correct1"] == int((model(x).argmax(1) == y).sum())
    printed = capsys.readouterr().out
    assert "native" in printed and "tome(r=2)" in printed


def test_eval_dora_per_block_statistics(setup_files):
    root, csv_path, weights, actor = setup_files
    res = _eval(root, csv_path, weights, "--method", "dora", "--actor", str(actor))
    native, dora = res["rows"]
    assert dora["method"] == "dora" and dora["attn_backend"] == "sdpa_loop"
    assert native["correct1"] - dora["correct1"] == dora["degraded"] - dora["improved"]
    assert dora["paired_drop"] == pytest.approx(native["top1"] - dora["top1"])
    assert dora["gflops_min"] <= dora["gflops"] <= dora["gflops_max"]
    blocks = dora["per_block"]
    assert len(blocks) == 12 and any(b["gate_rate"] > 0 for b in blocks)
    for b in blocks:
        assert 0.0 <= b["gate_rate"] <= 1.0
        if b["gate_rate"] > 0:
            assert 2 <= b["budget_min"] <= b["budget_mean"] <= b["budget_max"]
        else:
            assert b["budget_min"] is None and b["budget_mean"] is None
    assert native["top1"] == _eval(root, csv_path, weights, "--method", "native")["rows"][0]["top1"]
    # the graph-replayed forward (uncaptured on the CPU) decides the same (last batch: 2 images, a
    # second batch shape)
    graphs = _eval(root, csv_path, weights, "--method", "dora", "--actor", str(actor), "--cuda-graphs")
    assert "--cuda-graphs" in graphs["command"]
    g = graphs["rows"][1]
    assert g["per_block"] == blocks and g["gflops"] == dora["gflops"] and g["top1"] == dora["top1"]


def test_eval_merge_flag_overrides_the_actors_mode(setup_files, capsys):
    """``--merge`` folds a deleting actor's removals (as ``wrap(..., merge=True)`` does),
    ``--no-merge`` deletes them, as the actor's default does here; each run's row says which."""
    from timm_dora.evaluate import DoraMethod, evaluate

    root, csv_path, weights, actor = setup_files
    plain = _eval(root, csv_path, weights, "--method", "dora", "--actor", str(actor))["rows"][1]
    off = _eval(root, csv_path, weights, "--method", "dora", "--actor", str(actor), "--no-merge")["rows"][1]
    on = _eval(root, csv_path, weights, "--method", "dora", "--actor", str(actor), "--merge")["rows"][1]
    assert "merge" not in plain["config"] and off["config"]["merge"] is False and on["config"]["merge"] is True
    keys = ("top1", "gflops", "gflops_min", "gflops_max", "per_block")
    assert {k: off[k] for k in keys} == {k: plain[k] for k in keys}
    model = load_model(MODEL, str(weights), img_size=IMG, num_classes=CLASSES)
    batch = preload(open_split(csv_path, "test", eval_transform(model)))
    _, ref = evaluate(model, [DoraMethod(model, str(actor), merge=True)], [batch])  # merging, by wrap's option
    assert on["top1"] == ref["top1"]  # (one batch here, batches of 4 there: sums in another order)
    assert [on[k] for k in keys[1:4]] == pytest.approx([ref[k] for k in keys[1:4]], rel=1e-9)
    for got, want in zip(on["per_block"], ref["per_block"], strict=True):
        assert got.keys() == want.keys()
        assert all(got[k] == want[k] if want[k] is None else got[k] == pytest.approx(want[k], rel=1e-9) for k in want)
    assert on["gflops"] != plain["gflops"]  # the flag changed what ran (the matching's MACs at least)


def test_eval_selector_substitution_reports_dora_and_substitute(setup_files):
    root, csv_path, weights, actor = setup_files
    res = _eval(root, csv_path, weights, "--method", "similarity", "--actor", str(actor), "--limit", "6")
    names = [r["method"] for r in res["rows"]]
    assert names == ["native", "dora", "similarity"]
    dora, sim = res["rows"][1], res["rows"][2]
    assert [b["gate_rate"] for b in sim["per_block"]] == [b["gate_rate"] for b in dora["per_block"]]
    assert [b["budget_mean"] for b in sim["per_block"]] == [b["budget_mean"] for b in dora["per_block"]]


def test_eval_static_schedule(setup_files):
    root, csv_path, weights, _ = setup_files
    res = _eval(root, csv_path, weights, "--method", "static", "--schedule", "2:4,5:4", "--rule", "cls_sim")
    row = res["rows"][1]
    assert row["method"] == "static-cls_sim(2:4,5:4)" and row["config"]["schedule"] == {"2": 4, "5": 4}
    assert row["per_block"][2]["budget_mean"] == 4 and row["per_block"][5]["tokens_mean"] == 8


def test_bench_cli_smoke(setup_files):
    root, csv_path, weights, _ = setup_files
    out = root / "bench.json"
    rc = main(["bench", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--device", "cpu", "--method", "tome", "--r", "2", "--data", str(csv_path), "--batch", "4", "--batches", "3",
               "--warmup", "1", "--iters", "2", "--repeats", "2", "--workers", "0", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["inputs"]["inputs"] == "real" and res["inputs"]["batches"] == 2  # 10 images -> 2 full batches of 4
    assert res["protocol"]["iters"] == 2 and res["protocol"]["repeats"] == 2
    for row in res["rows"]:
        assert row["images_per_s"] > 0 and row["ms_per_batch"] > 0 and len(row["repeats_images_per_s"]) == 2
        assert row["attention_ops"]
    assert [r["method"] for r in res["rows"]] == ["native", "tome(r=2)"]


def test_time_forward_protocol():
    from timm_dora.evaluate.bench import time_forward

    calls = []
    res = time_forward(lambda x: calls.append(x.shape[0]), [torch.zeros(3, 1), torch.zeros(3, 1)], warmup=2, iters=5, repeats=3)
    assert len(calls) == 3 * (2 + 5) and res["batch"] == 3 and len(res["repeats_ms_per_batch"]) == 3
    assert res["images_per_s"] > 0
    assert "steady_peak_memory_mib" not in res  # (CUDA only)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (its allocator's statistics)")
def test_time_forward_peak_memory_in_two_phases():
    """A first call that allocates 64 MiB more (as a capture's warm-up does) shows in the warm-up
    peak, not in the steady one; steady calls that hold 16 MiB show there."""
    from timm_dora.evaluate.bench import time_forward

    x = torch.zeros(4, 1, device="cuda")
    state = {"first": True}

    def fn(x):
        extra = torch.empty((64 if state["first"] else 16) * 2**20, dtype=torch.uint8, device="cuda")
        state["first"] = False
        return extra.fill_(1)[:1]  # (nothing else allocated)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**20
    res = time_forward(fn, x, warmup=2, iters=3, repeats=2)
    assert res["warmup_peak_memory_mib"] - base >= 64
    assert 16 <= res["steady_peak_memory_mib"] - base < 32


def test_paired_counts_and_their_standard_error_by_hand():
    """Degraded / improved images against native and the paired drop's standard error, in two
    batches (the counts accumulate), against values computed by hand."""
    from timm_dora.evaluate import Output, Tally

    def onehot(pred, classes=5):
        return torch.nn.functional.one_hot(torch.tensor(pred), classes).float()

    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    native = torch.tensor([0, 1, 2, 3, 0, 1])  # right on images 0-3
    method = torch.tensor([0, 1, 4, 4, 4, 2])  # right on 0, 1 and 4: degrades 2 and 3, improves 4
    tally = Tally("m")
    for sl in (slice(0, 4), slice(4, 6)):
        out = Output(onehot(method[sl].tolist()), torch.ones(sl.stop - sl.start, dtype=torch.float64))
        tally.update(out, labels[sl], native[sl])
    row = tally.result()
    assert (row["degraded"], row["improved"], row["correct1"]) == (2, 1, 3)
    assert row["paired_drop"] == pytest.approx(100 * 1 / 6)  # = native's 4/6 minus the method's 3/6
    # per-image differences (1, 1, -1, 0, 0, 0): mean 1/6, variance 3/6 - 1/36 = 17/36
    assert row["paired_drop_se"] == pytest.approx(100 * (17 / 36 / 6) ** 0.5)
    assert "degraded" not in Tally("native").result()


def test_rows_without_native_have_no_agreement_or_paired_drop(setup_files):
    """``evaluate(..., native=False)``: agreement and the paired comparison are unknown (None /
    absent), not 0; with native they count against native's own predictions."""
    from timm_dora.evaluate import ToMeMethod, evaluate

    root, csv_path, weights, _ = setup_files
    model = load_model(MODEL, str(weights), img_size=IMG, num_classes=CLASSES)
    x, y = preload(open_split(csv_path, "test", eval_transform(model)))
    m = ToMeMethod(model, 2)
    (alone,) = evaluate(model, [m], [(x, y)], native=False)
    assert alone["method"] == "tome(r=2)" and alone["agreement"] is None and "paired_drop" not in alone
    native, tome = evaluate(model, [m], [(x, y)])
    with torch.no_grad():
        ref = model(x).argmax(1)
        pred = m.outputs(x)["tome(r=2)"].logits.argmax(1)
    assert tome["agreement"] == pytest.approx(100.0 * float((pred == ref).float().mean()))
    assert tome["degraded"] == int(((ref == y) & (pred != y)).sum()) and tome["improved"] == int(((pred == y) & (ref != y)).sum())
    assert tome["paired_drop"] == pytest.approx(native["top1"] - tome["top1"])


# --------------------------------------------------------------------------------------------
# everyday use: errors, progress, workers


def test_cli_errors_are_one_line(setup_files, capsys):
    root, csv_path, weights, _ = setup_files
    common = ["--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
              "--device", "cpu", "--workers", "0"]
    rc = main(["eval", *common, "--data", str(root / "missing.csv"), "--method", "native", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("timm-dora eval: error: ") and "missing.csv" in err
    rc = main(["eval", "--model", "deit_small_patch16_224", "--random-weights", "--img-size", str(IMG), "--device", "cpu",
               "--data", str(csv_path), "--quiet"])  # no actor is registered for it
    assert rc == 1 and capsys.readouterr().err.startswith(
        "timm-dora eval: error: no pretrained DORA actor is registered for 'deit_small_patch16_224.fb_in1k'; available: ")
    rc = main(["eval", *common, "--data", str(csv_path), "--actor", str(root / "no-actor"), "--quiet"])
    assert rc == 1 and capsys.readouterr().err == f"timm-dora eval: error: no actor folder at {root / 'no-actor'}\n"
    rc = main(["bench", *common, "--method", "tome", "--batch", "4", "--warmup", "0", "--iters", "1", "--repeats", "1"])
    assert rc == 1 and capsys.readouterr().err.endswith("timm-dora bench: error: --method tome needs --r (one value, or one per block)\n")


def test_cli_refuses_empty_batches(setup_files, capsys):
    root, csv_path, weights, _ = setup_files
    for command in (["eval", "--data", str(csv_path)], ["bench"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--model", MODEL, "--weights", str(weights), "--batch", "0"])
        assert exit_.value.code == 2 and "argument --batch: must be 1 or more, got 0" in capsys.readouterr().err


def test_eval_progress_bar(setup_files, capsys):
    root, csv_path, weights, _ = setup_files
    rc = main(["eval", "--model", MODEL, "--weights", str(weights), "--img-size", str(IMG), "--num-classes", str(CLASSES),
               "--data", str(csv_path), "--device", "cpu", "--batch", "4", "--workers", "0", "--method", "native"])
    err = capsys.readouterr().err
    assert rc == 0 and "eval native" in err and "10/10" in err and "images10" not in err


def test_time_forward_reports_progress_after_each_repeat():
    from timm_dora.evaluate.bench import time_forward

    events = []
    time_forward(lambda x: events.append("forward"), [torch.zeros(2, 1)], warmup=1, iters=2, repeats=3,
                 progress=lambda: events.append("repeat"))
    assert events == ["forward"] * 3 + ["repeat"] + (["forward"] * 3 + ["repeat"]) * 2


def test_data_workers_are_capped_at_the_cpus(setup_files, monkeypatch):
    import os

    from timm_dora.data import worker_count
    from timm_dora.evaluate import loader_for

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert (worker_count(0), worker_count(1), worker_count(4)) == (0, 1, 2)
    with pytest.raises(ValueError, match="0 or more, got -1"):
        worker_count(-1)
    _, csv_path, _, _ = setup_files
    model = make_model(MODEL, img_size=IMG, num_classes=CLASSES)
    assert loader_for(model, str(csv_path), "test", workers=4).loader.num_workers == 2


def test_eval_at_another_input_size(setup_files):
    """``--input-size``: the model takes other sizes through timm's dynamic_img_size and the images
    are preprocessed at that size; native and DORA are counted at its patch count (48 px: 9)."""
    from timm_dora import native_gflops

    root, csv_path, weights, actor = setup_files
    res = _eval(root, csv_path, weights, "--input-size", "48", "--actor", str(actor))
    assert res["preprocessing"]["input_size"] == [3, 48, 48]
    native, dora = res["rows"]
    model = load_model(MODEL, str(weights), img_size=IMG, num_classes=CLASSES)
    assert native["gflops"] == pytest.approx(native_gflops(model, 9), rel=1e-12)
    assert all(b["tokens_mean"] <= 9 for b in dora["per_block"]) and dora["gflops"] <= native["gflops"] + 0.01


def test_baselines_refuse_what_they_cannot_count(setup_files):
    from timm_dora.evaluate import build_method

    dynamic = load_model(MODEL, random_weights=True, img_size=IMG, num_classes=CLASSES, dynamic_img_size=True)
    tome = build_method(dynamic, "tome", r=2)
    with pytest.raises(ValueError, match="ToMe is counted at the model's own input size"):
        tome.outputs(torch.randn(1, 3, 48, 48))
    no_cls = make_model("vit_tiny_patch16_224", img_size=IMG, class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="no class token \\(use rule 'slice'\\)"):
        build_method(no_cls, "static", schedule="3:4")
    assert build_method(no_cls, "static", schedule="3:4", rule="slice").outputs(torch.randn(1, 3, IMG, IMG))


def test_eval_with_skip_dead_lowers_every_row_by_the_dead_mlp(setup_files):
    """``--skip-dead``: native and the method leave out the last block's MLP on the tokens the CLS
    readout never reads: the same predictions, the GFLOPs lower by exactly that MLP on the tokens
    surviving the last block."""
    root, csv_path, weights, actor = setup_files
    plain = _eval(root, csv_path, weights, "--actor", str(actor))
    lean = _eval(root, csv_path, weights, "--actor", str(actor), "--skip-dead")
    model = load_model(MODEL, str(weights), img_size=IMG, num_classes=CLASSES)
    mlp = 2 * model.embed_dim * 4 * model.embed_dim  # MACs per token of the last MLP
    (native, dora), (lean_native, lean_dora) = plain["rows"], lean["rows"]
    for a, b in ((native, lean_native), (dora, lean_dora)):
        assert (a["method"], a["correct1"], a.get("agreement")) == (b["method"], b["correct1"], b.get("agreement"))
    assert native["gflops"] - lean_native["gflops"] == pytest.approx(2 * mlp * 16 / 1e9, abs=1e-12)
    # DORA: that MLP on the tokens surviving its last block, and its actor's decision there (none now)
    assert dora["gflops"] - lean_dora["gflops"] >= 2 * mlp * dora["per_block"][-1]["tokens_mean"] / 1e9 - 1e-12
    assert lean_dora["per_block"][-1]["gate_rate"] == 0.0 and lean_dora["config"]["skip_dead"] is True


@pytest.mark.parametrize("method", ["tome", "pitome", "mctf", "repshift", "zerotprune"])
def test_every_reduction_baseline_is_built_by_name_with_its_own_logits_and_gflops(method):
    """``build_method`` gives each token-reduction baseline's own forward and cost, refuses a
    missing ``--r`` in one line, and ``--no-prop-attn`` only where it means something."""
    from timm_dora.evaluate import ReductionMethod, build_method
    from timm_dora.evaluate.baselines import MCTF, PiToMe, RepShift, ToMe, ZeroTPrune

    name, kw = SMALL_FAMILIES["deit"]
    model = make_model(name, **kw)
    m = build_method(model, method, r=[2])
    fn = {"tome": ToMe, "pitome": PiToMe, "mctf": MCTF, "repshift": RepShift, "zerotprune": ZeroTPrune}[method](model, 2)
    assert isinstance(m, ReductionMethod) and m.name == fn.name and m.config["r_effective"] == fn.cost.r
    x = images(model, 2)
    out = m.outputs(x)[m.name]
    assert torch.equal(out.logits, fn(x)) and out.gflops.tolist() == [fn.cost.gflops] * 2
    with pytest.raises(ValueError, match=f"--method {method} needs --r"):
        build_method(model, method)
    if method in ("mctf", "repshift", "zerotprune"):
        with pytest.raises(ValueError, match=f"--no-prop-attn applies to tome and pitome, not {method}"):
            build_method(model, method, r=2, prop_attn=False)
