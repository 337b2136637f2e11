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


def test_versions_module_entry_and_the_train_hint(capsys):
    from timm_dora.cli import main as cli

    r = subprocess.run([sys.executable, "-m", "timm_dora", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"timm-dora {timm_dora.__version__}", r  # python -m timm_dora
    with pytest.raises(SystemExit) as e:
        train_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"timm-dora-train {timm_dora.__version__}"
    assert cli(["train", "--model", "x"]) == 2 and "timm-dora-train --help" in capsys.readouterr().err
    assert cli([]) == 2
    out = capsys.readouterr().out
    assert "eval" in out and "timm-dora-train" in out


VIT_TINY = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The Hub cannot be reached (the probe says so), its cache is empty, and any download fails the test."""
    import huggingface_hub

    import timm_dora.hub.published as published

    real = huggingface_hub.hf_hub_download

    def download(*a, **k):  # the cache may be read (an empty one), the network not
        assert k.get("local_files_only"), "the Hub was asked"
        return real(*a, **{**k, "cache_dir": tmp_path / "hf_cache"})

    monkeypatch.setattr(published, "hub_reachable", lambda timeout=None: (False, "test: no network"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)


@pytest.mark.parametrize("name", [f"hf-hub:timm-dora/{VIT_TINY}", f"timm-dora/{VIT_TINY}", VIT_TINY])
def test_every_name_of_a_shipped_actor_loads_it_from_the_package(no_hub, name):
    from timm_dora.train.checkpoints import actor_width

    shipped = timm_dora.Actor.from_pretrained(str(packaged_actor(VIT_TINY)))
    loaded = timm_dora.Actor.from_pretrained(name)  # the model card's own snippet, among others
    assert loaded.state_dict().keys() == shipped.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in shipped.state_dict().items())
    assert actor_width(None, name, None) == shipped.width  # --init-actor's path


def test_an_actor_neither_shipped_nor_cached_fails_at_once_when_the_hub_is_unreachable(no_hub, tmp_path, data, capsys):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match=r"^actor 'someone/not_an_actor' is on the Hugging Face Hub, which "
                                                r"cannot be reached \(test: no network\), and it is not in the local "
                                                r"cache: pass a local actor folder"):
        timm_dora.Actor.from_pretrained("someone/not_an_actor")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    common = ["--model", "vit_tiny_patch16_224", "--weights", str(tmp_path / "w.safetensors"), "--data", str(data),
              "--device", "cpu", "--out", str(tmp_path / "out")]
    from timm_dora.cli import main as cli

    for args in (["calibrate", "--actor", "someone/not_an_actor", "--target-reduction", "30", "--splits", "qc"],
                 ["distill", "--teacher", "someone/not_an_actor", "--splits", "rollout", "--eval-split", "dev"]):
        rc = cli([*args, *common])
        _one_line_error(capsys, rc, "actor 'someone/not_an_actor' is on the Hugging Face Hub, which cannot be reached")
    assert not (tmp_path / "out").exists()


def _images(root, corrupt: int = 1):
    """A labels CSV of three test images, the second one a truncated JPEG."""
    from PIL import Image

    rows = ["path,label,synset,set,split"]
    for i in range(3):
        arr = (torch.rand(48, 48, 3, generator=torch.Generator().manual_seed(i)) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).save(root / f"{i}.jpg")
        rows.append(f"{i}.jpg,{i},n{i:08d},x,test")
    (root / f"{corrupt}.jpg").write_bytes((root / f"{corrupt}.jpg").read_bytes()[:300])
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def test_a_corrupt_image_in_an_evaluation_is_left_out_named_and_counted(tmp_path, capsys):
    from timm_dora.cli import main as cli

    labels = _images(tmp_path)
    rc = cli(["eval", "--model", "vit_tiny_patch16_224", "--random-weights", "--img-size", "32", "--method", "native",
              "--data", str(labels), "--workers", "1", "--quiet", "--out", str(tmp_path / "eval.json")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    warnings = [ln for ln in out.err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and f"skipped unreadable image {tmp_path / '1.jpg'}: OSError" in warnings[0]
    assert "1 unreadable image(s) left out; 2 evaluated" in out.out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["data"]["images"] == 2 and result["data"]["skipped_unreadable"] == [str(tmp_path / "1.jpg")]
    assert result["rows"][0]["images"] == 2


def test_weights_of_another_model_are_one_short_line(tmp_path, capsys):
    from safetensors.torch import save_file

    from timm_dora.cli import main as cli

    tiny = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32)
    save_file(tiny.state_dict(), str(tmp_path / "tiny.safetensors"))
    rc = cli(["eval", "--model", "vit_small_patch16_224", "--img-size", "32", "--weights",
              str(tmp_path / "tiny.safetensors"), "--data", str(tmp_path)])
    err = _one_line_error(capsys, rc, f"weights {tmp_path / 'tiny.safetensors'} (width 192, 12 blocks, 1000 classes) "
                                      "do not fit model vit_small_patch16_224 (width 384, 12 blocks, 1000 classes)")
    assert len(err) < 500


def test_bench_on_a_cpu_takes_a_small_protocol_and_prints_no_probe_noise(tmp_path, capfd):
    from timm_dora.cli import main as cli

    rc = cli(["bench", "--model", "vit_tiny_patch16_224", "--random-weights", "--img-size", "32", "--device", "cpu",
              "--out", str(tmp_path / "bench.json")])
    out = capfd.readouterr()
    assert rc == 0, out.err
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {k: result["protocol"][k] for k in ("batch", "warmup", "iters", "repeats")} == \
        {"batch": 8, "warmup": 2, "iters": 5, "repeats": 3}
    assert "defaults for a CPU: --batch 8, --batches 2, --warmup 2, --iters 5, --repeats 3" in out.err
    for noise in ("gpuGetDeviceCount", "USDT", "profiler_start"):
        assert noise not in out.err + out.out


def test_training_on_a_cpu_says_how_long_it_would_take_and_how_to_shorten_it(monkeypatch):
    from timm_dora.engine import native_gflops
    from timm_dora.train.config import config_from_args
    from timm_dora.train.runtime import cpu_estimate

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    base = ["--model", VIT_TINY, "--data", "d.csv", "--out", "o", "--random-backbone", "--device", "cpu"]
    note = cpu_estimate(config_from_args(build_parser().parse_args(base)))
    per_update = 0.38 * native_gflops(timm.create_model(VIT_TINY, pretrained=False)) * 256 / 2
    assert note == (f"training on the CPU (2 cores): about {per_update:.0f} s an update, so 1171 updates take about "
                    f"{per_update * 1171 / 3600:.0f} h; for a short run pass --max-minutes 30 (or --updates N, "
                    "--rollout-images N); on a GPU an update takes about a second")
    for short in (["--max-minutes", "30"], ["--updates", "4"]):
        assert cpu_estimate(config_from_args(build_parser().parse_args(base + short))) == ""


def test_the_cpu_note_comes_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    rc = train_main(["--model", VIT_TINY, "--data", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "run"),
                     "--random-backbone", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 1 and len(err) == 2 and err[0].startswith("timm-dora-train: training on the CPU (2 cores): about ")
    assert "data spec not found" in err[1]


def test_the_package_says_it_is_typed():
    from pathlib import Path

    root = Path(timm_dora.__file__).parent
    assert (root / "py.typed").is_file()
    assert '"py.typed"' in (root.parent / "pyproject.toml").read_text()  # (shipped as package data)


def test_a_run_that_fails_early_leaves_no_empty_out_folder(tmp_path, capsys):
    rc = train_main([*ARGS, "--data", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "run")])
    _one_line_error(capsys, rc, "data spec not found")
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made stays
    rc = train_main([*ARGS, "--data", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "mine")])
    assert rc == 1 and (tmp_path / "mine").is_dir()


def test_publish_upload_without_the_hub_is_one_line(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    import timm_dora.hub as hub

    spec = importlib.util.spec_from_file_location("publish", Path(__file__).resolve().parents[1] / "hub" / "publish.py")
    publish = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(publish)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=None: (False, "test: no network"))
    assert publish.main(["--upload"]) == 1
    out = capsys.readouterr()
    assert out.err == "cannot upload: the Hugging Face Hub cannot be reached (test: no network); nothing uploaded\n"
    assert out.out.count("ok   ") == 2  # validated first


def test_viz_needs_the_backbone_weights_named_and_says_when_they_are_random(tmp_path, capsys):
    from PIL import Image

    from timm_dora.cli import main as cli

    Image.new("RGB", (40, 40)).save(tmp_path / "a.png")
    base = ["viz", "trajectory", "--model", "deit_tiny_patch16_224", "--img-size", "64", "--images",
            str(tmp_path / "a.png"), "--format", "png"]
    rc = cli([*base, "--out", str(tmp_path / "none")])
    _one_line_error(capsys, rc, "pass one of --weights FILE, --pretrained (timm downloads them) or --random-weights")
    assert not (tmp_path / "none").exists()
    pytest.importorskip("matplotlib")
    assert cli([*base, "--random-weights", "--actor", "random", "--out", str(tmp_path / "pic")]) == 0
    title = json.loads((tmp_path / "pic" / "trajectory.json").read_text())["title"]
    assert title.startswith("deit_tiny_patch16_224 (random weights), untrained actor")
