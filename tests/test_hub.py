"""Pretrained actors: save/load round trip, the huggingface_hub cache path, resolution, errors, publish."""
import importlib.util
import json
import shutil
import socket
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError
from safetensors.torch import load_file, save_file

import timm_dora
import timm_dora.hub as hub
import timm_dora.hub.published as hub_published
from timm_dora import Actor
from timm_dora.policy import encoder_sizes
from timm_dora.train.selection import select_checkpoint

from helpers import hub_cache, images, make_model, offline  # noqa: F401 (offline: fixture)

REPO = Path(__file__).resolve().parents[1]
ARCH = "deit_tiny_patch16_224"
NAME = f"{ARCH}.fb_in1k"  # make_model keeps timm's default pretrained_cfg (tag fb_in1k)
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def small_model(**kw):
    return make_model(ARCH, img_size=64, **kw)


def random_actor(model, seed=0):
    """An actor whose random weights prune a lot (gate biased open, scores spread)."""
    torch.manual_seed(seed)
    actor = Actor.for_model(model)
    with torch.no_grad():
        for p in actor.parameters():
            p.normal_(0.0, 0.5)
        actor.gate_mlp[2].bias.fill_(3.0)
    return actor.eval()


@torch.no_grad()
def decisions(model, actor):
    timm_dora.wrap(model, actor)
    try:
        return model(images(model, 4)), model.dora_stats.removed.clone()
    finally:
        timm_dora.unwrap(model)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Calls(list):
    """``(repo_id, filename, revision)`` of each call; ``cached_only``: whether each asked for
    cached files only (``local_files_only``: no request)."""

    cached_only: list


@pytest.fixture
def spy(monkeypatch):
    """Record every huggingface_hub.hf_hub_download call (and still run the real one)."""
    calls = Calls()
    calls.cached_only = []
    real = huggingface_hub.hf_hub_download

    def recording(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw.get("revision")))
        calls.cached_only.append(bool(kw.get("local_files_only")))
        return real(repo_id, filename, **kw)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    return calls


@pytest.fixture
def saved(tmp_path):
    """(model, actor, folder): a random actor for the small DeiT, saved with save_pretrained."""
    model = small_model()
    actor = random_actor(model)
    folder = hub.save_pretrained(actor, tmp_path / "actor", backbone=model, extra={"target_drop": 0.01})
    return model, actor, folder


def edit_config(folder, edit):
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# --------------------------------------------------------------------------------------------
# save / load


def test_round_trip_same_decisions(saved):
    model, actor, folder = saved
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == "timm-dora-actor" and config["format_version"] == 1
    assert config["library_version"] == timm_dora.__version__
    assert config["actor"] == actor.config()
    assert config["budget_grid"] == actor.budgets.tolist() == list(range(2, 13, 2))
    assert config["backbone"] == {
        "architecture": ARCH, "pretrained_tag": "fb_in1k", "embed_dim": 192, "depth": 12,
        "num_patches": 16, "num_prefix_tokens": 1, "readout": "model",
    }
    assert config["training"] == {"target_drop": 0.01}

    loaded = Actor.from_pretrained(folder)
    assert isinstance(loaded, Actor) and not loaded.training
    assert loaded.pretrained_config == config
    assert same_weights(actor, loaded)
    logits, removed = decisions(model, actor)
    logits2, removed2 = decisions(model, loaded)
    assert removed.sum() > 0  # the comparison is about real pruning decisions
    assert torch.equal(removed, removed2)
    assert torch.equal(logits, logits2)


def test_methods_attached(tmp_path):
    model = small_model()
    actor = random_actor(model)
    actor.save_pretrained(tmp_path, backbone=hub.backbone_info(model, "lc1"))
    loaded, config = hub.load_pretrained(str(tmp_path))
    assert config["backbone"]["readout"] == "lc1"
    assert same_weights(actor, loaded)


def test_push_to_hub_uploads_saved_folder(tmp_path, monkeypatch):
    model = small_model()
    actor = random_actor(model)
    seen = {}

    class FakeApi:
        def __init__(self, token=None):
            seen["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            seen["create"] = (repo_id, private, exist_ok)
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, repo_id, folder_path, commit_message):
            seen["upload"] = (repo_id, commit_message)
            shutil.copytree(folder_path, tmp_path / "uploaded")
            return "commit"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert actor.push_to_hub("org/actor", token="t", private=True, backbone=model) == "commit"
    assert seen["token"] == "t" and seen["create"] == ("org/actor", True, True)
    assert seen["upload"][0] == "org/actor"
    assert same_weights(actor, Actor.from_pretrained(tmp_path / "uploaded"))


# --------------------------------------------------------------------------------------------
# through huggingface_hub's cache


def test_hub_cache_offline_revisions(saved, tmp_path, offline, spy):
    model, actor, folder = saved
    other = random_actor(model, seed=1)
    folder_b = hub.save_pretrained(other, tmp_path / "b", backbone=model)
    cache = tmp_path / "cache"
    hub_cache(cache, "org/actor", {COMMIT_A: folder, COMMIT_B: folder_b}, {"main": COMMIT_A, "v1": COMMIT_B})

    assert same_weights(actor, Actor.from_pretrained("hf-hub:org/actor", cache_dir=cache))
    assert spy == [("org/actor", "config.json", None), ("org/actor", "model.safetensors", None)]
    # a branch/tag is resolved through refs/, a commit through snapshots/, by huggingface_hub
    assert same_weights(other, Actor.from_pretrained("org/actor", revision="v1", cache_dir=cache))
    assert same_weights(other, Actor.from_pretrained("org/actor", revision=COMMIT_B, cache_dir=cache))
    assert spy[-1] == ("org/actor", "model.safetensors", COMMIT_B)
    with pytest.raises(LocalEntryNotFoundError):  # not cached while offline: huggingface_hub's error
        hub.load_pretrained("org/absent", cache_dir=cache)


def test_hub_cache_local_files_only(saved, tmp_path, spy):
    model, actor, folder = saved
    cache = tmp_path / "cache"
    hub_cache(cache, "org/actor", {COMMIT_A: folder}, {"main": COMMIT_A})
    loaded, _ = hub.load_pretrained("org/actor", cache_dir=cache, local_files_only=True)
    assert same_weights(actor, loaded) and len(spy) == 2


# --------------------------------------------------------------------------------------------
# resolution


def test_registry_lists_planned_actors():
    names = hub.available_actors()
    assert names == ["deit_tiny_patch16_224.fb_in1k", "vit_tiny_patch16_224.augreg_in21k_ft_in1k"]
    for name, entry in hub.registry().items():
        assert entry == {"repo_id": f"timm-dora/{name}", "folder": name}
        assert (REPO / "timm_dora" / "hub" / "actors" / name / "config.json").is_file()


def test_resolve_registered_actor_from_the_package_with_no_network(spy, monkeypatch):
    """wrap(model) with no actor: the registered actor for the model's pretrained_cfg is read from
    this package (offline first), with no Hub call, even with no connection at all."""
    import timm

    monkeypatch.setattr(socket, "create_connection", no_connection)
    with torch.device("meta"):
        model = timm.create_model(NAME, pretrained=False)
    resolved = hub.resolve_actor(model)
    packaged, _ = hub.load_pretrained(hub.ACTORS_DIR / NAME)
    assert same_weights(packaged, resolved) and spy == []
    assert hub.packaged_actor(NAME) == hub.ACTORS_DIR / NAME


def test_resolve_from_pretrained_cfg(saved, tmp_path, offline, spy, monkeypatch):
    model, actor, folder = saved
    shipped = tmp_path / "shipped"  # the package's actors folder, holding this small model's actor
    shutil.copytree(folder, shipped / NAME)
    monkeypatch.setattr(hub_published, "ACTORS_DIR", shipped)
    resolved = hub.resolve_actor(model)  # registry: pretrained_cfg -> the shipped folder
    assert same_weights(actor, resolved) and spy == []
    assert torch.equal(decisions(model, actor)[1], decisions(model, resolved)[1])
    assert hub.resolve_actor(model, actor) is actor
    cache = tmp_path / "cache"
    hub_cache(cache, f"timm-dora/{NAME}", {COMMIT_A: folder}, {"main": COMMIT_A})
    # the shipped actor's Hub name: the package's copy, no Hub call; a revision asks for the Hub's
    assert same_weights(actor, hub.resolve_actor(model, f"hf-hub:timm-dora/{NAME}", readout="model")) and spy == []
    assert same_weights(actor, hub.resolve_actor(model, f"hf-hub:timm-dora/{NAME}", cache_dir=cache, readout="model",
                                                 revision="main"))
    assert spy[0] == (f"timm-dora/{NAME}", "config.json", "main")
    assert same_weights(actor, hub.resolve_actor(model, folder))
    assert same_weights(actor, hub.resolve_actor(model, str(folder)))
    # registered but not shipped: its Hub repository (here from the cache: offline)
    monkeypatch.setattr(hub_published, "ACTORS_DIR", tmp_path / "empty")
    assert same_weights(actor, hub.resolve_actor(model, cache_dir=cache))


def no_connection(*args, **kwargs):
    raise OSError("[Errno -2] Name or service not known")


def test_unreachable_hub_fails_at_once_or_reads_the_cache(saved, tmp_path, monkeypatch, spy):
    """No connection and HF_HUB_OFFLINE unset: a Hub actor comes from the cache, and one that is not
    cached fails at once, saying what to pass: huggingface_hub is asked for cached files only, so
    it makes no request (alone it retries a failing one for about 25 s)."""
    model, actor, folder = saved
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", no_connection)
    for name in hub_published.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert hub.hub_reachable() == (False, "huggingface.co is unreachable ([Errno -2] Name or service not known)")
    cache = tmp_path / "cache"
    hub_cache(cache, "org/actor", {COMMIT_A: folder}, {"main": COMMIT_A})
    assert same_weights(actor, hub.resolve_actor(model, "org/actor", cache_dir=cache))
    with pytest.raises(FileNotFoundError, match=r"actor 'org/absent' is on the Hugging Face Hub, which cannot be "
                       r"reached \(huggingface.co is unreachable .*\), and it is not in the local cache: pass a local "
                       r"actor folder"):
        hub.resolve_actor(model, "org/absent", cache_dir=cache)
    assert spy == [("org/actor", "config.json", None), ("org/actor", "model.safetensors", None),
                   ("org/absent", "config.json", None)]
    assert spy.cached_only == [True, True, True]
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # a direct connection proves nothing there
    assert hub.hub_reachable() == (True, "")


def test_resolve_errors(saved, tmp_path, offline, monkeypatch):
    model, _, folder = saved
    with pytest.raises(ValueError, match=r"no pretrained DORA actor is registered for 'deit_tiny_distilled.*available: "
                       r"deit_tiny_patch16_224\.fb_in1k, vit_tiny_patch16_224\.augreg_in21k_ft_in1k"):
        hub.resolve_actor(make_model("deit_tiny_distilled_patch16_224", img_size=64))
    with pytest.raises(TypeError, match="actor must be"):
        hub.resolve_actor(model, 3)
    with pytest.raises(ValueError, match="backbone.readout='model', not readout='lc1'"):
        hub.resolve_actor(model, folder, readout="lc1")
    with pytest.raises(FileNotFoundError, match="no actor folder"):
        hub.resolve_actor(model, str(tmp_path / "missing" / "actor"))
    # the shipped actor is checked against the model like any other
    with pytest.raises(ValueError, match="config backbone.depth=12 but the model has depth=6"):
        hub.resolve_actor(make_model(ARCH, img_size=64, depth=6))
    # registered, not shipped, not cached, HF_HUB_OFFLINE=1: at once, saying what to pass
    monkeypatch.setattr(hub_published, "ACTORS_DIR", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"actor 'timm-dora/deit_tiny_patch16_224.fb_in1k' is on the Hugging "
                       r"Face Hub, which cannot be reached \(HF_HUB_OFFLINE is set\)"):
        hub.resolve_actor(model, cache_dir=tmp_path / "empty-cache")


# --------------------------------------------------------------------------------------------
# clear errors


def test_pickle_refused_local(tmp_path, saved):
    _, _, folder = saved
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle checkpoints .* are refused; timm-dora only loads safetensors"):
        hub.load_pretrained(folder)
    only_pt = tmp_path / "only_pt"
    only_pt.mkdir()
    (only_pt / "actor.pth").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints"):
        hub.load_pretrained(only_pt)


def test_pickle_refused_hub(saved, tmp_path, offline, monkeypatch):
    _, _, folder = saved
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    cache = tmp_path / "cache"
    hub_cache(cache, "org/pickled", {COMMIT_A: folder}, {"main": COMMIT_A})
    with pytest.raises(ValueError, match="Hub repo org/pickled has no model.safetensors: pickle checkpoints"):
        hub.load_pretrained("org/pickled", cache_dir=cache)

    # online, the Hub answers "entry not found" for model.safetensors
    def fake_download(repo_id, filename, **kw):
        if filename == "config.json":
            return str(folder / "config.json")
        raise EntryNotFoundError("404 model.safetensors")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(ValueError, match="Hub repo org/remote has no model.safetensors: pickle checkpoints"):
        hub.load_pretrained("org/remote")


BAD_FIELDS = [
    ("format", lambda c: c.update(format="timm-actor")),
    ("format_version", lambda c: c.update(format_version="1")),
    ("format_version", lambda c: c.update(format_version=2)),
    ("library_version", lambda c: c.update(library_version=1)),
    ("actor", lambda c: c.update(actor=[192, 12, 16])),
    ("actor.embed_dim", lambda c: c["actor"].update(embed_dim=0)),
    ("actor.depth", lambda c: c["actor"].update(depth=12.0)),
    ("actor.width", lambda c: c["actor"].update(width=True)),
    ("actor.num_patches", lambda c: c["actor"].pop("num_patches")),
    ("actor.dropout", lambda c: c["actor"].update(dropout=1)),
    ("actor.num_heads", lambda c: c["actor"].update(num_heads=3)),
    ("actor.num_patches", lambda c: c["actor"].update(min_keep=15)),
    ("budget_grid", lambda c: c.update(budget_grid=c["budget_grid"][:-1])),
    ("budget_grid", lambda c: c.update(budget_grid="2..12")),
    ("backbone", lambda c: c.update(backbone="deit")),
    ("backbone.architecture", lambda c: c["backbone"].update(architecture=5)),
    ("backbone.num_prefix_tokens", lambda c: c["backbone"].update(num_prefix_tokens=-1)),
    ("backbone.readout", lambda c: c["backbone"].update(readout="cls")),
    ("backbone.depth", lambda c: c["backbone"].update(depth=6)),
    ("training", lambda c: c.update(training=[])),
]


@pytest.mark.parametrize("field,edit", BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_bad_config_field_named_before_tensors(saved, field, edit):
    _, _, folder = saved
    (folder / "model.safetensors").write_bytes(b"garbage: reading it would fail differently")
    edit_config(folder, edit)
    with pytest.raises(ValueError, match=rf"invalid actor config field '{field}'"):
        hub.load_pretrained(folder)


def test_invalid_json(saved):
    _, _, folder = saved
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        hub.load_pretrained(folder)


def test_shape_mismatch_names_tensor_and_field(saved):
    _, _, folder = saved

    def halve_d(c):
        c["actor"]["embed_dim"] = c["backbone"]["embed_dim"] = 96

    edit_config(folder, halve_d)
    with pytest.raises(ValueError, match=r"gate_mlp\.0\.weight has shape \[64, 211\] but config actor\.embed_dim=96, actor\.gate_hidden=64, "
                       r"actor\.gate_embed_dim=16 gives \[64, 115\]"):
        hub.load_pretrained(folder)
    edit_config(folder, lambda c: (c["actor"].update(embed_dim=192, gate_hidden=32), c["backbone"].update(embed_dim=192)))
    with pytest.raises(ValueError, match=r"gate_mlp\.0\.bias has shape \[64\] but config actor\.gate_hidden=32 gives \[32\]"):
        hub.load_pretrained(folder)


def test_missing_and_unexpected_tensors(saved):
    _, _, folder = saved
    path = folder / "model.safetensors"
    state = load_file(path)
    save_file({**state, "extra": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra'\]"):
        hub.load_pretrained(folder)
    del state["w_in.bias"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"missing tensors \['w_in.bias'\]"):
        hub.load_pretrained(folder)
    state["w_in.bias"] = torch.zeros(128, dtype=torch.int64)
    save_file(state, path)
    with pytest.raises(ValueError, match="w_in.bias has dtype I64"):
        hub.load_pretrained(folder)


def test_backbone_mismatch(saved):
    _, _, folder = saved
    _, config = hub.load_pretrained(folder)
    hub.check_backbone(config, small_model(), "model")
    with pytest.raises(ValueError, match="backbone.architecture='deit_tiny_patch16_224' but the model is 'vit_tiny_patch16_224'"):
        hub.check_backbone(config, make_model("vit_tiny_patch16_224", img_size=64))
    with pytest.raises(ValueError, match="backbone.depth=12 but the model has depth=6"):
        hub.check_backbone(config, small_model(depth=6))
    hub.check_backbone(config, make_model(ARCH, img_size=48))  # another input size: the grid is read as fractions
    no_cls = make_model(ARCH, img_size=64, class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="reads the CLS key .* the model has no class token"):
        hub.check_backbone(config, no_cls)
    with pytest.raises(ValueError, match="backbone.num_prefix_tokens=1 but the model has num_prefix_tokens=2"):
        hub.check_backbone(config, make_model(ARCH, img_size=64, reg_tokens=1))
    with pytest.raises(ValueError, match="backbone.readout"):
        hub.check_backbone(config, small_model(), "lc1")
    config["backbone"]["pretrained_tag"] = "other_tag"
    with pytest.warns(UserWarning, match="other_tag"):
        hub.check_backbone(config, small_model())
    config["backbone"] = None  # sizes only, through the actor config
    with pytest.raises(ValueError, match="actor.depth=12 but the model has depth=6"):
        hub.check_backbone(config, small_model(depth=6))


# --------------------------------------------------------------------------------------------
# hub/ folder and publish.py


def load_publish():
    spec = importlib.util.spec_from_file_location("dora_publish", REPO / "hub" / "publish.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hub_configs_fit_real_backbones():
    import timm

    for name, entry in hub.registry().items():
        config = json.loads((REPO / "timm_dora" / "hub" / "actors" / entry["folder"] / "config.json").read_text())
        hub.validate_config(config)
        training = config["training"]
        assert training["model"] == name
        if "distillation" in training:  # timm-dora distill: a narrower student of a timm-dora-train actor
            assert training["distillation"]["width"] == config["actor"]["width"] and "dev_spread_pct" in training
            training = training["teacher"]  # the teacher's own record
        assert training["target_drop"] == 0.01 and training["model"] == name
        record = training["selection"]
        assert record["selected"]["name"] == f"u{training['updates']:05d}"
        # the recorded dev numbers, selected again at the recorded target by the recorded rule, give the published checkpoint
        again = select_checkpoint(record["checkpoints"], record["target_pp"], record.get("rule", "min"))
        assert (again.record.name, again.violates) == (record["selected"]["name"], record["violates"])
        actor, loaded = hub.load_pretrained(REPO / "timm_dora" / "hub" / "actors" / entry["folder"])  # weights fit the config
        assert loaded == config and isinstance(actor, Actor)
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert config["backbone"] == hub.backbone_info(model)
        # the paper's actor, or a narrower one of timm-dora-train --actor-width, deleting or (--merge) merging
        merge = config["actor"].get("merge", False)
        assert config["actor"] == Actor.for_model(model, merge=merge, **encoder_sizes(config["actor"]["width"])).config()
        hub.check_backbone(config, model, "model")


def test_publish_dry_run_validates_hub(capsys):
    assert load_publish().main([]) == 0
    out = capsys.readouterr().out
    for name in hub.available_actors():
        assert f"ok   {name}" in out
    assert "dry run" in out


def test_publish_fails_and_uploads(saved, tmp_path, monkeypatch, capsys):
    _, _, folder = saved
    publish = load_publish()
    root = tmp_path / "hubroot"
    shutil.copytree(folder, root / NAME)
    shutil.copy(REPO / "timm_dora" / "hub" / "actors" / NAME / "README.md", root / NAME / "README.md")
    (root / "registry.json").write_text(json.dumps({NAME: {"repo_id": f"org/{NAME}", "folder": NAME}}))

    uploaded = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, exist_ok=False):
            assert exist_ok

        def upload_folder(self, repo_id, folder_path, allow_patterns, commit_message):
            uploaded.append((repo_id, Path(folder_path).name))

    monkeypatch.setattr(publish, "HfApi", FakeApi)
    monkeypatch.setattr(publish.hub, "hub_reachable", lambda timeout=None: (True, ""))
    assert publish.main(["--root", str(root)]) == 0
    assert "1 folder(s) would be uploaded" in capsys.readouterr().out and not uploaded
    assert publish.main(["--root", str(root), "--upload"]) == 0
    assert uploaded == [(f"org/{NAME}", NAME)]

    (root / NAME / "pytorch_model.bin").write_bytes(b"x")
    edit_config(root / NAME, lambda c: c["actor"].update(depth=0))
    (root / NAME / "README.md").write_text("# no metadata\n")
    (root / "stray").mkdir()
    assert publish.main(["--root", str(root), "--upload"]) == 1
    out = capsys.readouterr().out
    assert "unexpected file pytorch_model.bin" in out
    assert "'actor.depth'" in out
    assert "no metadata header" in out
    assert "stray: folder is not in registry.json" in out
    assert "nothing uploaded" in out and len(uploaded) == 1


def test_summary_key_actor_round_trip(tmp_path):
    model = make_model("vit_base_patch16_gap_224", img_size=64, embed_dim=192, num_heads=3)
    actor = Actor.for_model(model)
    assert actor.summary == "mean"
    folder = hub.save_pretrained(actor, tmp_path / "gap", backbone=model)
    loaded, config = hub.load_pretrained(folder)
    assert config["actor"]["summary"] == "mean" and loaded.summary == "mean" and same_weights(actor, loaded)
    hub.check_backbone(config, model)
    edit_config(folder, lambda c: c["actor"].update(summary="register"))
    with pytest.raises(ValueError, match="invalid actor config field 'actor.summary': must be one of"):
        hub.load_pretrained(folder)
