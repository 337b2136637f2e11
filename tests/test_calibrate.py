"""``Actor.tilted`` and ``timm-dora calibrate`` (:mod:`timm_dora.evaluate.calibrate`): an actor's
operating point moved by a budget tilt, found by bisection on GFLOPs alone; tiny random ViT, CPU."""
import json
import math

import pytest
import timm
import torch

from test_train import data  # noqa: F401  (the `data` fixture: generated images and labels.csv)
from timm_dora import Actor
from timm_dora.cli import main as cli
from timm_dora.engine import native_gflops
from timm_dora.evaluate import loader_for
from timm_dora.evaluate.calibrate import calibrate_tilt, mean_reduction, search_tilt


def _model_and_actor():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=4).eval()
    actor = Actor.for_model(model).eval()
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(3.0)  # gates open: the budgets decide the GFLOPs
        for p in actor.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model, actor


def test_a_tilt_subtracts_per_token_times_the_budget_from_each_logit_and_leaves_the_actor_alone():
    _, actor = _model_and_actor()
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    z = torch.randn(5, actor.width)
    n_visual = torch.full((5,), actor.num_patches)
    tilted = actor.tilted(0.25)
    want = actor.budget_logits(z, n_visual) - 0.25 * actor.budgets.float()
    torch.testing.assert_close(tilted.budget_logits(z, n_visual), want)
    assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())
    changed = [k for k, v in tilted.state_dict().items() if not torch.equal(before[k], v)]
    assert changed == ["budget_head.3.bias"]
    # far enough, the tilt alone decides: the smallest budget one way, the largest feasible the other
    assert (tilted.tilted(1e4).budget_logits(z, n_visual).argmax(1) == 0).all()
    assert (actor.tilted(-1e4).budget_logits(z, n_visual).argmax(1) == actor.budgets.numel() - 1).all()


def test_search_tilt_finds_the_largest_tilt_that_still_reaches_the_target():
    steps = lambda t: 40.0 - 10.0 * (t > 0.3) - 10.0 * (t > 0.7) + 10.0 * (t < -0.45)  # noqa: E731
    t, history = search_tilt(steps, 35.0, steps=20)
    assert 0.3 - 1e-5 < t <= 0.3 and steps(t) >= 35.0
    assert [h["tilt"] for h in history[:4]] == [0.0, 0.05, 0.1, 0.2] and history[4]["reduction_pct"] == 30.0
    t, _ = search_tilt(steps, 45.0, steps=20)  # the other way: more pruning than the actor's own
    assert -0.45 - 1e-5 < t < -0.45 and steps(t) >= 45.0
    with pytest.raises(ValueError, match=r"^no budget tilt within \+-100 reaches a 60 % GFLOPs reduction "
                                         r"\(the tilts tried gave 40.0-50.0 %\)$"):
        search_tilt(steps, 60.0)


def test_calibration_reaches_the_target_on_the_images_and_a_smaller_tilt_overshoots_it():
    model, actor = _model_and_actor()
    batches = [torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    _, own = mean_reduction(model, actor, batches)
    _, floor = mean_reduction(model, actor.tilted(1e4), batches)  # the smallest budget wherever a gate opens
    assert own - floor > 2.0  # (the setup: room to calibrate in)
    target = 0.5 * (own + floor)
    tilted, record = calibrate_tilt(model, actor, batches, target, steps=10)
    gflops, reduction = mean_reduction(model, tilted, batches)
    assert reduction >= target and record["reduction_pct"] == reduction and record["gflops"] == gflops
    assert record["native_gflops"] == native_gflops(model) and record["images"] == 16
    ok = [h for h in record["search"] if h["reduction_pct"] >= target]
    assert record["tilt_per_token"] == max(h["tilt"] for h in ok) > 0
    bad = min(h["tilt"] for h in record["search"] if h["reduction_pct"] < target)
    doubled = [h["tilt"] for h in record["search"][1:] if h["tilt"] > 0 and math.log2(h["tilt"] / 0.05).is_integer()]
    width = max(doubled) / 2 if len(doubled) > 1 else max(doubled)  # the bracket found: [t / 2, t] or [0, t]
    assert 0 < bad - record["tilt_per_token"] <= width / 2**10 * (1 + 1e-9)  # ten halvings closed it
    with pytest.raises(ValueError, match=r"^the target reduction is a percentage in \(0, 100\), got 120$"):
        calibrate_tilt(model, actor, batches, 120.0)


def test_cli_saves_a_loadable_calibrated_actor_and_refuses_the_test_split(data, tmp_path, capsys):  # noqa: F811
    model, actor = _model_and_actor()
    actor.save_pretrained(tmp_path / "actor", backbone=model, extra={"updates": 7})
    images = [x for split in ("qc", "dev") for x, *_ in loader_for(model, str(data), split, batch=256, workers=0)]
    target = round(0.5 * (mean_reduction(model, actor, images)[1] + mean_reduction(model, actor.tilted(1e4), images)[1]), 2)
    args = ["calibrate", "--model", "vit_tiny_patch16_224", "--actor", str(tmp_path / "actor"), "--data", str(data),
            "--splits", "qc", "dev", "--target-reduction", str(target), "--steps", "4", "--workers", "0",
            "--device", "cpu", "--out", str(tmp_path / "calibrated")]
    with pytest.MonkeyPatch.context() as mp:  # the tiny model of the fixture's images
        import timm_dora.evaluate.calibrate as calibrate_module

        mp.setattr(calibrate_module, "load_model", lambda name, weights: model)
        assert cli(args) == 0
        config = json.loads((tmp_path / "calibrated" / "config.json").read_text())
        rec = config["training"]["calibration"]
        assert config["training"]["updates"] == 7 and rec["images"] == 8 and rec["splits"] == ["qc", "dev"]
        assert rec["reduction_pct"] >= target and rec["target_reduction_pct"] == target and rec["tilt_per_token"] > 0
        calibrated = Actor.from_pretrained(tmp_path / "calibrated")
        torch.testing.assert_close(calibrated.budget_head[3].bias,
                                   actor.tilted(rec["tilt_per_token"]).budget_head[3].bias)
        assert cli(args[:-1] + [str(tmp_path / "bad"), "--splits", "test"]) == 1
    assert capsys.readouterr().err.endswith(
        "error: --splits must not include test: calibrating on it would make a choice on the test images\n")


def test_a_missed_target_is_recorded_and_warned_about(monkeypatch, capsys):
    import timm_dora.evaluate.calibrate as calibrate_module

    class Tilt:  # an actor stand-in whose reduction is a step in its tilt: 45.6 % up to 0, 30 % above
        num_patches = 16

        def __init__(self, t=0.0):
            self.t = t

        def tilted(self, t):
            return Tilt(t)

    monkeypatch.setattr(calibrate_module, "mean_reduction",
                        lambda model, actor, batches, cuda_graphs=False: (1.0, 45.6 if actor.t <= 0 else 30.0))
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64)
    with pytest.warns(UserWarning, match=r"^calibration missed its target by 5.6 pp"):
        tilted, record = calibrate_tilt(model, Tilt(), [torch.zeros(2, 3, 64, 64)], 40.0, steps=3)
    # 0 (45.6) then 0.05 (30): bracket [0, 0.05], halved three times to 0.00625, each 30 %
    assert tilted.t == 0.0 and [h["tilt"] for h in record["search"]] == [0.0, 0.05, 0.025, 0.0125, 0.00625]
    assert record["missed"] == ("reached 45.6 % for a 40 % target; the nearest tilt past it, +0.00625, gave 30.0 %: "
                                "more --steps narrow the bracket, unless the reduction jumps there")
    _, record = calibrate_tilt(model, Tilt(), [torch.zeros(2, 3, 64, 64)], 45.0, steps=3)  # within 1 pp: no miss
    assert "missed" not in record


def test_calibrate_help_reads_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        cli(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "move a trained actor's operating point to a GFLOPs reduction, without retraining and without labels." in text
