"""benchmarks/baselines.py on the CPU: a random tiny backbone and actor, two methods, tiny settings;
the JSON's fields, its identities, and resuming from the per-setting state."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import baselines

from test_compare import save_half_open_actor
from test_evaluate import make_dataset


def test_baselines_run_writes_curves_comparisons_and_shift_and_resumes(tmp_path):
    csv_path = make_dataset(tmp_path, n_test=8, n_dev=4)
    save_half_open_actor(tmp_path / "actor")
    out = tmp_path / "baselines.json"
    argv = ["--model", "vit_tiny_patch16_224", "--random-weights", "--img-size", "64", "--device", "cpu",
            "--actor", str(tmp_path / "actor"), "--data", str(csv_path), "--calibration-data", str(csv_path),
            "--calibration-splits", "dev", "--dora-targets", "30", "--calibration-steps", "2",
            "--methods", "tome", "mctf", "--r", "1", "3", "--families", "contrast", "--severities", "1",
            "--resamples", "20", "--batch", "4", "--batches", "1", "--warmup", "1", "--iters", "1", "--repeats", "1",
            "--workers", "0", "--out", str(out)]
    first = baselines.main(argv)
    res = json.loads(out.read_text())
    assert res["data"]["images"] == 8 and res["command"].startswith("python -m benchmarks.baselines --model ")
    assert res["device"] and res["torch"] == torch.__version__
    native = res["native"]
    assert native["images_per_s"] > 0 and native["gflops"] > 0
    curve = res["dora"]["curve"]
    assert [p["knob"] for p in curve] == ["published", 30]
    assert curve[1]["calibration"]["target_reduction_pct"] == 30.0 and res["dora"]["unreachable_targets"] == []
    assert sorted(res["methods"]) == ["mctf", "tome"]
    for name, m in res["methods"].items():
        assert m["knob"] == "r" and [p["knob"] for p in m["sweep"]] == [1, 3]
        for p in m["sweep"]:  # the paired drop is native's top-1 minus the method's, on the same images
            assert p["paired_drop"] == pytest.approx(native["top1"] - p["top1"])
            assert p["images_per_s"] > 0 and 0 < p["gflops"] < native["gflops"] and p["paired_drop_se"] >= 0
        assert [v["drop_pp"] for v in m["vs_dora"]] == [0.5, 1.0, 1.5]
        for v in m["vs_dora"]:
            assert v["verdict"] in ("reference wins", "method wins", "unresolved", "undefined")
            assert (v["ci95"] is None) == (v["verdict"] == "undefined")
    rows = res["shift"]["rows"]
    assert {(r["method"], r["family"], r["severity"]) for r in rows} == {
        (m, "contrast", 1) for m in ("dora", "tome", "mctf")}
    for r in rows:
        assert r["paired_drop"] == pytest.approx(r["native_top1"] - 100.0 * (r["native_top1"] / 100.0 - r["paired_drop"] / 100.0))
        assert r["gflops"] > 0
    # the picture: every curve, its numbers as the document has them
    from timm_dora.cli import main as cli

    assert cli(["viz", "tradeoff", "--results", str(out), "--out", str(tmp_path / "viz"), "--format", "svg"]) == 0
    drawn = json.loads((tmp_path / "viz" / "comparison.json").read_text())[0]
    assert list(drawn["curves"]) == ["DORA", "ToMe", "MCTF"]
    assert sorted(p["gflops"] for p in drawn["curves"]["ToMe"]) == sorted(p["gflops"] for p in res["methods"]["tome"]["sweep"])
    svg = (tmp_path / "viz" / "comparison.svg").read_text()
    assert "ToMe|gflops" in svg and "DORA|throughput" in svg and "native|gflops" in svg
    text = baselines.table([res])  # the README's table: native, DORA, each method at DORA's GFLOPs
    assert text.count("\n") == 1 + 4 and "| vit_tiny | **DORA** (published) |" in text and "| vit_tiny | ToMe (r " in text
    # a second run reads every setting from the state file and writes the same numbers; without the
    # pool it keeps DORA's calibrated points, and --forget measures a method afresh (the same on a CPU)
    i = argv.index("--calibration-data")
    again = baselines.main(argv[:i] + argv[i + 2:] + ["--forget", "mctf"])
    timing = ("command", "images_per_s", "repeats_images_per_s")

    def strip(d):  # everything but the command and the timings (mctf was timed again)
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in timing}
        return [strip(v) for v in d] if isinstance(d, list) else d

    assert json.dumps(strip(again), sort_keys=True) == json.dumps(strip(first), sort_keys=True)
    assert again["native"]["images_per_s"] == first["native"]["images_per_s"]  # (read back, not measured)
    # --report-only writes the file from the state alone, keeping the measuring run's device and versions
    reported = baselines.main(argv[:i] + argv[i + 2:] + ["--report-only", "--note", "n"])
    same = {k: v for k, v in reported.items() if k != "report_command"}
    assert json.dumps(strip(same), sort_keys=True) == json.dumps(strip({**again, "note": "n"}), sort_keys=True)
    assert reported["report_command"].startswith("python -m benchmarks.baselines") and reported["shift"]["missing"] == []
    with pytest.raises(ValueError, match="never measured"):
        baselines.main(argv[:i] + argv[i + 2:] + ["--report-only", "--r", "1", "3", "5"])


def test_baselines_refuses_to_calibrate_on_the_evaluation_split(tmp_path):
    with pytest.raises(SystemExit):
        baselines.main(["--model", "vit_tiny_patch16_224", "--data", "x.csv", "--calibration-splits", "test",
                        "--out", str(tmp_path / "o.json")])
