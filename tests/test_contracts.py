"""A wrapped model keeps timm's contracts (#58, CPU, fp32): checkpoints load both ways strictly,
it pickles and deep-copies as a wrapped model, wrapping twice with the same actor is a no-op and a
different one says what differs, TorchScript and tracing of an actor are refused in one line (a
fixed plan exports), and the timm utilities that worked keep working."""
import copy
import io
import pickle

import pytest
import timm
import torch

import timm_dora
from timm_dora.policy import ReplayPolicy

from helpers import make_model, random_plan

REGISTERED = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # an actor ships for it


def _wrapped(seed: int = 0, depth: int = 3):
    model = make_model("vit_tiny_patch16_224", seed=seed, img_size=64, depth=depth)
    torch.manual_seed(seed + 1)
    actor = timm_dora.Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(4.0)  # opens at most blocks
    return timm_dora.wrap(model, actor)


def _x(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _run(model, x):
    return model(x), model.dora_stats.removed.clone()


def test_the_actor_opens_gates_in_these_tests():
    _, removed = _run(_wrapped(), _x())
    assert removed.sum() > 0  # otherwise the equalities below would not see the actor at all


def test_native_checkpoints_load_into_a_wrapped_model_strictly():
    other = make_model("vit_tiny_patch16_224", seed=5, img_size=64, depth=3)
    model = _wrapped()
    actor = {k: v.clone() for k, v in model.dora_actor.state_dict().items()}
    result = model.load_state_dict(other.state_dict(), strict=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    # the backbone is the other model's now, the actor unchanged: as if `other` had been wrapped
    for k, v in model.dora_actor.state_dict().items():
        assert torch.equal(v, actor[k])
    ref = timm_dora.wrap(other, copy.deepcopy(model.dora_actor))
    x = _x()
    out, removed = _run(model, x)
    ref_out, ref_removed = _run(ref, x)
    assert torch.equal(out, ref_out) and torch.equal(removed, ref_removed)


def test_timm_load_checkpoint_reads_a_native_checkpoint_into_a_wrapped_model(tmp_path):
    other = make_model("vit_tiny_patch16_224", seed=5, img_size=64, depth=3)
    path = tmp_path / "native.pth"
    torch.save({"state_dict": other.state_dict()}, path)
    model = _wrapped()
    timm.models.load_checkpoint(model, str(path), strict=True)
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_a_wrapped_state_dict_is_the_backbones_and_loads_into_the_native_model_strictly():
    model = _wrapped()
    native = make_model("vit_tiny_patch16_224", seed=0, img_size=64, depth=3)
    sd = model.state_dict()
    assert sorted(sd) == sorted(native.state_dict()) and not [k for k in sd if "dora" in k]
    fresh = make_model("vit_tiny_patch16_224", seed=9, img_size=64, depth=3)
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(_x()), native(_x()))
    # also as a submodule of a larger model (the prefix is kept)
    outer = torch.nn.Sequential(model)
    assert sorted(outer.state_dict()) == sorted("0." + k for k in sd)
    outer.load_state_dict(torch.nn.Sequential(native).state_dict(), strict=True)
    # an older checkpoint that still holds the actor's tensors loads them into the actor
    old = dict(sd, **{"dora_actor." + k: torch.zeros_like(v) for k, v in model.dora_actor.state_dict().items()})
    model.load_state_dict(old, strict=True)
    assert all(not v.any() for v in model.dora_actor.state_dict().values())


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_a_wrapped_model_pickles_and_runs_as_the_original(how):
    model = _wrapped()
    x = _x()
    out, removed = _run(model, x)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    elif how == "pickle":
        back = pickle.loads(pickle.dumps(model))
    else:
        back = copy.deepcopy(model)
    assert back is not model and back.dora_actor is not model.dora_actor
    assert timm_dora.is_wrapped(back) and back._dora.policy.actor is back.dora_actor  # wrapped again, one actor
    got, got_removed = _run(back, x)
    assert torch.equal(got, out) and torch.equal(got_removed, removed)
    native = timm_dora.unwrap(back)
    assert type(native) is timm.models.VisionTransformer and not hasattr(native, "dora_actor")


def test_a_replay_policy_and_its_options_survive_pickling():
    model = make_model("vit_tiny_patch16_224", img_size=64, depth=3)
    plan = random_plan(3, model.patch_embed.num_patches, 3, [0, 2], seed=4)
    timm_dora.wrap(model, policy=ReplayPolicy(plan), readout="model", cuda_graphs=False)
    back = pickle.loads(pickle.dumps(model))
    assert back._dora.options() == model._dora.options()
    out, removed = _run(model, _x())
    got, got_removed = _run(back, _x())
    assert torch.equal(got, out) and torch.equal(got_removed, removed)


def test_wrapping_again_with_the_same_actor_is_a_no_op(tmp_path):
    model = _wrapped()
    actor = model.dora_actor
    assert timm_dora.wrap(model, actor) is model and model.dora_actor is actor  # the same object
    assert timm_dora.wrap(model, copy.deepcopy(actor)) is model and model.dora_actor is actor  # an equal one
    actor.save_pretrained(tmp_path / "a")
    folder = make_model("vit_tiny_patch16_224", img_size=64, depth=3)
    timm_dora.wrap(folder, str(tmp_path / "a"))
    first = folder.dora_actor
    assert timm_dora.wrap(folder, str(tmp_path / "a")) is folder and folder.dora_actor is first  # the same folder
    registered = timm.create_model(REGISTERED, pretrained=False).eval()
    timm_dora.wrap(registered)
    first = registered.dora_actor
    assert timm_dora.wrap(registered) is registered and registered.dora_actor is first  # the registered actor


def test_wrapping_again_otherwise_says_what_differs():
    model = _wrapped()
    torch.manual_seed(123)
    other = timm_dora.Actor.for_model(model)
    with pytest.raises(ValueError, match=r"already wrapped with another actor \(its weights differ, first at "):
        timm_dora.wrap(model, other)
    wider = timm_dora.Actor.for_model(model, width=32)
    with pytest.raises(ValueError, match=r"another actor \(.*width"):
        timm_dora.wrap(model, wider)
    with pytest.raises(ValueError, match=r"already wrapped with readout='model' \(asked: 'lc1'\)"):
        timm_dora.wrap(model, model.dora_actor, readout="lc1")
    with pytest.raises(ValueError, match=r"already wrapped with merge=False \(asked: True\)"):
        timm_dora.wrap(model, model.dora_actor, merge=True)
    with pytest.raises(ValueError, match="speculate=False"):
        timm_dora.wrap(model, model.dora_actor, speculate=True)
    with pytest.raises(ValueError, match="already wrapped with another policy"):
        timm_dora.wrap(model, policy=timm_dora.NoPrune())


def test_torchscript_and_tracing_are_refused_in_one_line():
    model = _wrapped()
    with pytest.raises(TypeError, match=r"^torch\.jit\.script cannot compile a wrapped model .* torch\.compile\(model\)"):
        torch.jit.script(model)
    for trace in (lambda: torch.export.export(model, (_x(),)), lambda: torch.jit.trace(model, (_x(),))):
        with pytest.raises(Exception, match=r"cannot follow a wrapped model's decisions .* torch\.compile\(model\)") as e:
            trace()
        assert "\n" not in str(e.value).strip().split("cannot follow")[1]


def test_a_fixed_plan_exports_and_equals_the_eager_forward():
    model = make_model("vit_tiny_patch16_224", img_size=64, depth=3)
    timm_dora.wrap(model, policy=ReplayPolicy(random_plan(3, model.patch_embed.num_patches, 3, [0, 2], seed=4)))
    x = _x()
    out, removed = _run(model, x)
    assert removed.sum() > 0
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        assert torch.equal(exported.module()(x), out)


def test_timm_utilities_keep_working():
    model = _wrapped()
    x = _x()
    out, removed = _run(model, x)
    ema = timm.utils.ModelEmaV3(model, decay=0.9)
    got, _ = _run(ema.module, x)
    assert torch.equal(got, out)
    ema.update(model)
    with torch.no_grad():
        # (a channels-last convolution rounds differently, as in the native model)
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), out, rtol=0, atol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).shape == out.shape
        final, inter = model.forward_intermediates(x)  # timm's, unpruned
        assert len(inter) == 3
    native = make_model("vit_tiny_patch16_224", img_size=64, depth=3)
    assert timm.data.resolve_data_config({}, model=model) == timm.data.resolve_data_config({}, model=native)
    model.set_grad_checkpointing(True)
    model.reset_classifier(5)
    assert _run(model, x)[0].shape == (3, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured graphs)")
def test_a_captured_cuda_model_pickles_without_its_graphs_and_captures_again():
    model = _wrapped(depth=4).cuda().to(torch.bfloat16)
    x = _x(20).cuda().to(torch.bfloat16)
    with torch.inference_mode():
        model(x)  # (captures)
        out, removed = model(x), model.dora_stats.removed.clone()  # (replays)
    assert timm_dora.engine_info(model)["executor"] == "captured"
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert not back._dora.graphs and next(back.parameters()).is_cuda
    with torch.inference_mode():
        got = back(x)
        got = back(x)
        assert torch.equal(back.dora_stats.removed, removed)
    assert timm_dora.engine_info(back)["executor"] == "captured"
    torch.testing.assert_close(got, out, rtol=0, atol=0)
