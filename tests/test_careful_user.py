"""Nothing silently wrong (#57, CPU): each path a careful user tries either does what was asked or
says in one line what is wrong and what to do, before any long work and without writing anything."""
import json
import subprocess
import sys

import pytest
import timm
import torch

import timm_dora
from timm_dora.hub.published import packaged_actor
from timm_dora.train import build_parser, main as train_main

from test_train import ARGS, data  # noqa: F401  (the `data` fixture)


def _one_line_error(capsys, rc: int, *fragments: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    for f in fragments:
        assert f in err, err
    return err


def test_wrap_inside_inference_mode_and_no_grad_equals_wrap_outside():
    def fresh():
        m = timm.create_model("vit_tiny_patch16_224.augreg_in21k_ft_in1k", pretrained=False, img_size=64).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.05)
        return m

    x = torch.randn(2, 3, 64, 64)
    ref = timm_dora.wrap(fresh())
    with torch.no_grad():
        want = ref(x)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            model = timm_dora.wrap(fresh())  # the registered actor, loaded inside the block
            assert torch.equal(model(x), want)
        with torch.no_grad():
            assert torch.equal(model(x), want)  # and after the block


def test_an_actor_object_gets_the_same_backbone_check_as_its_folder():
    deit_actor = timm_dora.Actor.from_pretrained(str(packaged_actor("deit_tiny_patch16_224.fb_in1k")))
    vit = timm.create_model("vit_tiny_patch16_224.augreg_in21k_ft_in1k", pretrained=False).eval()
    with pytest.raises(ValueError, match="actor does not fit this model: config backbone.architecture='deit_tiny"):
        timm_dora.wrap(vit, deit_actor)
    assert not timm_dora.is_wrapped(vit)
    deit = timm.create_model("deit_tiny_patch16_224.fb_in1k", pretrained=False).eval()
    assert timm_dora.wrap(deit, deit_actor) is deit  # where it fits, as before


def test_training_without_backbone_weights_is_refused_before_any_work(tmp_path, data, capsys):
    args = [a for a in ARGS if a != "--random-backbone"]
    rc = train_main([*args, "--data", str(data), "--out", str(tmp_path / "run")])
    _one_line_error(capsys, rc, "no backbone weights: pass --weights FILE or --pretrained", "--random-backbone")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,value,says", [
    ("--checkpoint-every", "0", "--checkpoint-every must be at least 1, got 0"),
    ("--updates", "0", "--updates must be at least 1, got 0"),
    ("--eval-batch", "0", "--eval-batch must be at least 1, got 0"),
    ("--lr-gate", "0", "--lr-gate must be above 0, got 0.0"),
    ("--gamma", "1.5", "--gamma must be at most 1, got 1.5"),
    ("--feedback-ema", "1", "--feedback-ema must be below 1, got 1.0"),
    ("--data-workers", "-1", "--data-workers must be at least 0, got -1"),
])
def test_numbers_out_of_range_name_their_flag_before_any_work(tmp_path, data, capsys, flag, value, says):
    rc = train_main([*ARGS, "--data", str(data), "--out", str(tmp_path / "run"), flag, value])
    _one_line_error(capsys, rc, says)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--optimizer", "--lr-schedule", "--warmup-updates"])
def test_options_that_did_nothing_are_gone(tmp_path, data, capsys, flag):
    with pytest.raises(SystemExit) as e:
        train_main([*ARGS, "--data", str(data), "--out", str(tmp_path / "run"), flag, "bogus"])
    assert e.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_tensorboard_is_checked_at_the_start(tmp_path, data, capsys):
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    rc = train_main([*ARGS, "--data", str(data), "--out", str(tmp_path / "run"), "--tensorboard"])
    _one_line_error(capsys, rc, "--tensorboard needs the tensorboard package: pip install tensorboard")
    assert not (tmp_path / "run").exists()


def test_resume_refuses_changed_settings_and_names_them(tmp_path, data, capsys):
    out = tmp_path / "run"
    common = [*ARGS, "--data", str(data), "--out", str(out), "--max-minutes", "0.00001"]
    assert train_main(common) == 0  # stops after its first update, resumable
    config = (out / "config.json").read_text()
    capsys.readouterr()
    rc = train_main([*common, "--resume", "--seed", "7", "--lr-gate", "0.001"])
    _one_line_error(capsys, rc, "--resume: --lr-gate 0.001 (the run: 5e-05); --seed 7 (the run: 42) differ from",
                    "only --max-minutes, --updates, --tensorboard")
    assert (out / "config.json").read_text() == config  # nothing overwritten
    # what may change does: a longer time limit
    assert train_main([*[a for a in common if a != "0.00001"], "0.00002", "--resume"]) == 0


def test_train_help_has_a_line_for_every_option_and_clean_metavars():
    ap = build_parser()
    options = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 60
    assert [a.option_strings[0] for a in options if not a.help] == []
    text = ap.format_help()
    assert "__" not in text and "(default: None)" not in text
    for group in ("data:", "model:", "feedback (App. C):", "selection:", "speed:", "output:", "PPO (App. D):"):
        assert f"\n{group}\n" in text


def test_versions_module_entry_and_the_train_hint():
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True)  # noqa: E731
    for cmd in (["-m", "timm_dora", "--version"], ["-m", "timm_dora.train", "--version"]):
        r = run(*cmd)
        assert r.returncode == 0 and r.stdout.strip().endswith(timm_dora.__version__), r
    r = run("-m", "timm_dora", "train", "--model", "x")
    assert r.returncode == 2 and "timm-dora-train --help" in r.stderr
    r = run("-m", "timm_dora")
    assert r.returncode == 2 and "eval" in r.stdout and "timm-dora-train" in r.stdout
