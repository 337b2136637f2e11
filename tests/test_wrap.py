"""The wrapped forward against native timm and against an independent per-image reference."""
import pytest
import torch

import timm_dora
from timm_dora import Actor, ActorPolicy, NoPrune, ReplayPolicy

from helpers import (FULL_FAMILIES, SMALL_FAMILIES, Recorder, half_open_actor, images, make_model, plan_for_image, random_plan,
                     reference_forward)

ALL = {**SMALL_FAMILIES, **FULL_FAMILIES}
SMALL = list(SMALL_FAMILIES)


def closed_gate_actor(model):
    actor = Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(-1e4)
    return actor


@pytest.mark.parametrize("family", list(ALL))
@torch.no_grad()
def test_gate_closed_equals_native(family):
    name, kw = ALL[family]
    model = make_model(name, **kw)
    x = images(model, 3)
    native = model(x)
    timm_dora.wrap(model, closed_gate_actor(model))
    out = model(x)
    assert (out - native).abs().max().item() <= 1e-5
    assert not model.dora_stats.gate.any()
    assert (model.dora_stats.tokens == model.patch_embed.num_patches).all()
    timm_dora.unwrap(model)
    timm_dora.wrap(model, policy=NoPrune())
    assert (model(x) - native).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", list(ALL))
@torch.no_grad()
def test_fuzzed_deletions_match_per_image_reference(family):
    name, kw = ALL[family]
    model = make_model(name, **kw)
    b, n0, depth = 4, model.patch_embed.num_patches, len(model.blocks)
    blocks = [0, 1, depth // 2, depth - 1]
    plan = random_plan(b, n0, depth, blocks, seed=sum(map(ord, family)))
    x = images(model, b)
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    out = model(x)
    stats = model.dora_stats
    for i in range(b):
        dels = plan_for_image(plan, i)
        ref = reference_forward(model, x[i : i + 1], dels)
        assert (out[i] - ref[0]).abs().max().item() <= 1e-5, f"image {i}"
        expected_k = torch.tensor([len(dels.get(l, [])) for l in range(depth)])
        assert torch.equal(stats.removed[i], expected_k)
        assert torch.equal(stats.tokens[i], n0 - expected_k.cumsum(0))
        # removed patches by original grid index: replay the plan's columns on a list of ids
        alive = list(range(n0))
        for l in range(depth):
            gone = [alive[c] for c in dels.get(l, [])]
            rp = stats.removed_patches[l]
            got = [] if rp is None else sorted(rp[1][rp[0] == i].tolist())
            assert got == sorted(gone), (i, l)
            alive = [a for a in alive if a not in set(gone)]
    # per image variation really happened (otherwise the packed path was never exercised)
    assert any(len(set(col)) > 1 for col in stats.tokens.T.tolist())


@pytest.mark.parametrize("family", SMALL)
@torch.no_grad()
def test_actor_decisions_replay_to_reference_and_are_batch_independent(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 5, seed=7)
    stats = _replay_and_batch_independence(model, half_open_actor(model, x), x)
    assert stats.gate.any(), "random actor never opened its gate; the test would not exercise pruning"


def _replay_and_batch_independence(model, actor, x):
    """The actor's decisions on ``x`` replay to the per-image reference, and each image alone gets
    the same decisions and logits (no leakage between packed images); returns the batch's stats."""
    rec = Recorder(timm_dora.ActorPolicy(actor))
    timm_dora.wrap(model, policy=rec)
    out = model(x)
    stats = model.dora_stats
    for i in range(x.shape[0]):
        ref = reference_forward(model, x[i : i + 1], plan_for_image(rec.plan, i))
        assert (out[i] - ref[0]).abs().max().item() <= 1e-5
    timm_dora.unwrap(model)
    timm_dora.wrap(model, actor)
    for i in range(x.shape[0]):
        single = model(x[i : i + 1])
        assert torch.equal(model.dora_stats.removed[0], stats.removed[i])
        assert (single[0] - out[i]).abs().max().item() <= 1e-5
    timm_dora.unwrap(model)
    return stats


@torch.no_grad()
def test_lc1_readout_matches_reference():
    name, kw = FULL_FAMILIES["dinov2_b14"]
    model = make_model(name, **kw)
    model.head = torch.nn.Linear(2 * model.embed_dim, 10)
    plan = random_plan(3, model.patch_embed.num_patches, len(model.blocks), [2, 5, 9], seed=5)
    x = images(model, 3)
    timm_dora.wrap(model, policy=ReplayPolicy(plan), readout="lc1")
    out = model(x)
    for i in range(3):
        ref = reference_forward(model, x[i : i + 1], plan_for_image(plan, i), readout="lc1")
        assert (out[i] - ref[0]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_unwrap_restores_bit_identical_behaviour():
    name, kw = SMALL_FAMILIES["dinov2_registers"]
    model = make_model(name, **kw)
    cls, keys = type(model), set(model.state_dict())
    x = images(model, 2)
    native = model(x)
    timm_dora.wrap(model, Actor.for_model(model))
    assert timm_dora.is_wrapped(model) and "dora_actor.w_in.weight" in dict(model.named_parameters())
    assert set(model.state_dict()) == keys  # the actor's tensors live in its own files (test_contracts.py)
    model(x)
    timm_dora.unwrap(model)
    assert type(model) is cls and set(model.state_dict()) == keys
    assert not hasattr(model, "dora_stats") and not timm_dora.is_wrapped(model)
    assert torch.equal(model(x), native)


def test_wrap_twice_is_idempotent_or_errors():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    actor = Actor.for_model(model)
    assert timm_dora.wrap(model, actor) is model
    assert timm_dora.wrap(model, actor) is model  # same actor and options: no-op
    with pytest.raises(ValueError, match="already wrapped"):
        timm_dora.wrap(model, Actor.for_model(model))
    with pytest.raises(ValueError, match="already wrapped"):
        timm_dora.wrap(model, actor, readout="lc1")


def test_policy_of_returns_the_policy_the_model_runs():
    """``policy_of``: the actor's policy that ``wrap`` built, a ``policy=`` as given, the one
    ``set_policy`` put in; a one-line ``ValueError`` on a model that is not wrapped."""
    model = make_model("deit_tiny_patch16_224", img_size=64)
    with pytest.raises(ValueError, match="^model is not wrapped by timm_dora$"):
        timm_dora.policy_of(model)
    actor = Actor.for_model(model)
    timm_dora.wrap(model, actor)
    policy = timm_dora.policy_of(model)
    assert isinstance(policy, ActorPolicy) and policy.actor is actor and policy.actor is model.dora_actor
    no_prune = NoPrune()
    timm_dora.set_policy(model, no_prune)
    assert timm_dora.policy_of(model) is no_prune
    timm_dora.unwrap(model)
    timm_dora.wrap(model, policy=no_prune)
    assert timm_dora.policy_of(model) is no_prune
    timm_dora.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        timm_dora.policy_of(model)


@pytest.mark.parametrize("field,kwargs", [("embed_dim", dict(embed_dim=64)), ("depth", dict(depth=6))])
def test_mismatched_actor_names_the_field(field, kwargs):
    model = make_model("deit_tiny_patch16_224", img_size=64)
    cfg = dict(embed_dim=192, depth=12, num_patches=16)
    cfg.update(kwargs)
    with pytest.raises(ValueError, match=f"actor.{field}="):
        timm_dora.wrap(model, Actor(**cfg))
    assert not timm_dora.is_wrapped(model)


def test_unsupported_models_raise_clear_errors():
    import timm

    with pytest.raises(TypeError, match="VisionTransformer"):
        timm_dora.wrap(torch.nn.Linear(3, 3), policy=NoPrune())
    with pytest.raises(TypeError, match="VisionTransformer"):
        timm_dora.wrap(timm.create_model("resnet10t"), policy=NoPrune())
    no_cls = timm.create_model("vit_tiny_patch16_224", img_size=64, class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="reads the CLS key .* no class token; Actor.for_model"):
        timm_dora.wrap(no_cls, Actor(192, 12, 16))  # a CLS-form actor on a model without a class token
    with pytest.raises(ValueError, match="readout='lc1' .* reads the class token, and this model has none"):
        timm_dora.wrap(no_cls, policy=NoPrune(), readout="lc1")
    map_pos = timm.create_model("vit_tiny_patch16_224", img_size=64, global_pool="map")
    map_pos.attn_pool.pos_embed = torch.nn.Parameter(torch.zeros(16, 192))
    with pytest.raises(ValueError, match="MAP"):
        timm_dora.wrap(map_pos, policy=NoPrune())
    post = timm.create_model("vit_tiny_patch16_224", img_size=64, block_fn=timm.models.vision_transformer.ResPostBlock)
    with pytest.raises(TypeError, match="ResPostBlock"):
        timm_dora.wrap(post, policy=NoPrune())
    model = make_model("deit_tiny_patch16_224", img_size=64)
    with pytest.raises(ValueError, match="lc1"):
        timm_dora.wrap(model, policy=NoPrune(), readout="lc1")
    with pytest.raises(ValueError, match="readout"):
        timm_dora.wrap(model, policy=NoPrune(), readout="gap")
    with pytest.raises(ValueError, match="attn_backend"):
        timm_dora.wrap(model, policy=NoPrune(), attn_backend="xformers")
    with pytest.raises(ValueError, match="not both"):
        timm_dora.wrap(model, Actor.for_model(model), policy=NoPrune())
    unregistered = make_model("vit_small_patch16_224", img_size=64)
    with pytest.raises(ValueError, match="no pretrained DORA actor is registered"):
        timm_dora.wrap(unregistered)
    with pytest.raises(ValueError, match="not wrapped"):
        timm_dora.unwrap(model)


def test_impossible_backend_raises():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    timm_dora.wrap(model, policy=NoPrune(), attn_backend="torch_varlen")
    with pytest.raises(ValueError, match="cannot run on device 'cpu'"):
        model(torch.randn(1, 3, 64, 64))


def test_bad_replay_plan_raises():
    model = make_model("deit_tiny_patch16_224", img_size=64)
    plan = {0: (torch.tensor([0]), torch.tensor([16]))}
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    with pytest.raises(ValueError, match="beyond"):
        model(images(model, 1))


def test_real_vit_tiny_gate_closed_reproduces_native_predictions():
    import csv

    import timm
    from PIL import Image

    from helpers import SHARED

    weights = SHARED / "weights" / "vit_tiny_patch16_224.augreg_in21k_ft_in1k.safetensors"
    data = SHARED / "data" / "imagenet-mini"
    if not weights.exists():
        pytest.skip("../shared weights not present")
    model = timm.create_model(
        "vit_tiny_patch16_224.augreg_in21k_ft_in1k", pretrained=True, pretrained_cfg_overlay=dict(file=str(weights))
    ).eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    tf = timm.data.create_transform(**cfg)
    rows = [r for r in csv.DictReader(open(data / "labels.csv")) if r["split"] == "test"][:6]
    x = torch.stack([tf(Image.open(data / r["path"]).convert("RGB")) for r in rows])
    with torch.no_grad():
        native = model(x)
        timm_dora.wrap(model, closed_gate_actor(model))
        wrapped = model(x)
    assert (wrapped - native).abs().max().item() <= 1e-4
    assert torch.equal(wrapped.argmax(1), native.argmax(1))


@torch.no_grad()
def test_fp32_model_with_actor_runs_under_bf16_autocast():
    # regression: the encoder mixed an autocast (bf16) W_h output into an fp32 sum
    model = make_model("deit_tiny_patch16_224", img_size=64)
    actor = Actor.for_model(model)
    actor.gate_mlp[2].bias.fill_(1e4)  # every block tries to prune: the controller runs
    x = images(model, 3)
    timm_dora.wrap(model, actor)
    ref = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert model.dora_stats.gate.any()
    assert out.shape == ref.shape and torch.isfinite(out).all()


@torch.no_grad()
def test_no_activation_outlives_its_use():
    """Peak memory: while block l's MLP runs, the wrapped forward holds no reference to block l's
    keys, to the rows before a deletion, or to the patch embedding (native timm holds none either)."""
    import weakref

    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 3)
    seen = {}

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, ctx):
            seen[ctx.block] = {"keys": weakref.ref(ctx.keys), "rows": weakref.ref(ctx.packed.x)}
            return self.inner(ctx)

    def embed_hook(module, args, out):
        seen["embed"] = weakref.ref(out)

    dead = {}

    def mlp_hook(l):
        def hook(module, args):
            dead[l] = {k: r() is None for k, r in seen[l].items()}
            dead[l]["embed"] = seen["embed"]() is None
        return hook

    plan = random_plan(x.shape[0], model.patch_embed.num_patches, len(model.blocks), blocks=[1, 3], seed=0)
    timm_dora.wrap(model, policy=Spy(ReplayPolicy(plan)))
    hooks = [model.norm_pre.register_forward_hook(embed_hook)]
    hooks += [blk.mlp.register_forward_pre_hook(mlp_hook(l)) for l, blk in enumerate(model.blocks)]
    model(x)
    for h in hooks:
        h.remove()
    assert (model.dora_stats.removed[:, [1, 3]].sum(0) > 0).all()  # blocks 1 and 3 deleted rows
    assert dead == {l: {"keys": True, "rows": True, "embed": True} for l in range(len(model.blocks))}


def test_speculation_keeps_keys_only_until_the_gate_is_read():
    """With ``speculate=True`` the block's keys and pre-attention rows stay alive through the
    speculative MLP (the controller may still need them) and are dead when the gate has been read:
    at the MLP on the survivors of a pruning block nothing extra is alive. The patch embedding is
    alive only during block 0's speculative MLP (block 0's input rows are a view of it)."""
    import weakref

    from timm_dora import ActorPolicy

    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 3)
    seen, alive = {}, {}

    class Spy:
        speculate = True

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, ctx):
            raise AssertionError("a speculating policy is called through begin")

        def begin(self, ctx):
            seen[ctx.block] = {"keys": weakref.ref(ctx.keys), "rows": weakref.ref(ctx.packed.x)}
            return self.inner.begin(ctx)

    def embed_hook(module, args, out):
        seen["embed"] = weakref.ref(out)

    def mlp_hook(l):
        def hook(module, args):
            state = {k: r() is not None for k, r in seen[l].items()}
            state["embed"] = seen["embed"]() is not None
            alive.setdefault(l, []).append(state)
        return hook

    from benchmarks.common import gate_forced_actor

    timm_dora.wrap(model, policy=Spy(ActorPolicy(gate_forced_actor(model, [1, 3]), speculate=True)))
    hooks = [model.norm_pre.register_forward_hook(embed_hook)]
    hooks += [blk.mlp.register_forward_pre_hook(mlp_hook(l)) for l, blk in enumerate(model.blocks)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    assert (model.dora_stats.removed[:, [1, 3]].sum(0) > 0).all()
    speculative = {"keys": True, "rows": True}
    want = {l: [{**speculative, "embed": l == 0}] for l in range(len(model.blocks))}
    for l in (1, 3):  # the MLP on the survivors, after the gate was read
        want[l].append({"keys": False, "rows": False, "embed": False})
    assert alive == want


def test_actor_encoder_runs_with_the_blocks_qkv_output_freed():
    """The eager actor gathers the open images' keys, then drops every reference to the block's
    keys: its encoder runs with the backbone's qkv output (which the keys are a view of) freed,
    as a native forward has freed it by then (NOTES change 35: 69 MiB of ViT-Ti's peak at batch 320)."""
    import weakref

    from timm_dora import ActorPolicy

    from benchmarks.common import gate_forced_actor

    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = images(model, 3)
    qkv, alive_at_encode = {}, []

    class Spy(ActorPolicy):
        def __call__(self, ctx):
            base = ctx.keys._base  # the block's qkv output
            assert base is not None and base.shape[-1] == 3 * ctx.keys.shape[-1]
            qkv[ctx.block] = weakref.ref(base)
            del base
            return super().__call__(ctx)

    policy = Spy(gate_forced_actor(model, [1, 3]))
    encode = policy.actor.encode

    def spy_encode(*args, **kwargs):
        alive_at_encode.append(qkv[max(qkv)]() is not None)
        return encode(*args, **kwargs)

    policy.actor.encode = spy_encode
    timm_dora.wrap(model, policy=policy)
    with torch.no_grad():
        model(x)
    assert (model.dora_stats.removed[:, [1, 3]].sum(0) > 0).all()
    assert alive_at_encode == [False, False]  # the encoder ran at blocks 1 and 3, qkv output freed


@pytest.mark.parametrize("pool,readout", [("token", "model"), ("avg", "model"), ("token", "lc1")])
def test_empty_batch_as_timm_takes_it(pool, readout):
    """A batch of 0 images: timm returns [0, classes] logits; the wrapped model the same, and
    statistics of zero images."""
    kw = dict(global_pool=pool)
    if readout == "lc1":
        kw["num_classes"] = 7
    model = make_model("vit_tiny_patch16_224", img_size=64, **kw)
    if readout == "lc1":
        model.head = torch.nn.Linear(2 * model.embed_dim, 7)
    x = torch.zeros(0, 3, 64, 64)
    native = model(x) if readout == "model" else model.head(torch.zeros(0, 2 * model.embed_dim))
    timm_dora.wrap(model, Actor.for_model(model), readout=readout)
    with torch.no_grad():
        logits = model(x)
    s = model.dora_stats
    assert logits.shape == native.shape == (0, model.head.out_features) and logits.dtype == native.dtype
    assert s.tokens.shape == s.gate.shape == s.removed.shape == (0, 12) and s.gate.dtype == torch.bool
    assert s.gflops.shape == s.policy_gflops.shape == (0,) and s.removed_patches == [None] * 12


# --------------------------------------------------------------------------------------------
# any input size: a dynamic_img_size model at sizes other than its default (64 px, 16 patches)

DYNAMIC = ("vit_tiny_patch16_224", dict(img_size=64, dynamic_img_size=True))


@pytest.mark.parametrize("size", [48, 96])
@torch.no_grad()
def test_other_input_sizes_gate_off_and_fuzzed_deletions_match_the_reference(size):
    name, kw = DYNAMIC
    model = make_model(name, **kw)
    n0, depth = (size // 16) ** 2, len(model.blocks)
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(size))
    native = model(x)
    timm_dora.wrap(model, closed_gate_actor(model))
    assert (model(x) - native).abs().max().item() <= 1e-5
    s = model.dora_stats
    assert not s.gate.any() and (s.tokens == n0).all()
    timm_dora.unwrap(model)
    timm_dora.wrap(model, policy=NoPrune())
    assert (model(x) - native).abs().max().item() <= 1e-5
    assert torch.allclose(model.dora_stats.gflops, torch.full((4,), timm_dora.native_gflops(model, n0), dtype=torch.float64))
    timm_dora.unwrap(model)
    plan = random_plan(4, n0, depth, [0, 3, depth - 1], seed=size, min_keep=2)
    timm_dora.wrap(model, policy=ReplayPolicy(plan))
    out = model(x)
    for i in range(4):
        ref = reference_forward(model, x[i : i + 1], plan_for_image(plan, i))
        assert (out[i] - ref[0]).abs().max().item() <= 1e-5
    assert any(len(set(col)) > 1 for col in model.dora_stats.tokens.T.tolist())
    timm_dora.unwrap(model)
    assert torch.equal(model(x), native)  # unwrap: native again, bit for bit


@pytest.mark.parametrize("size", [48, 96])
@torch.no_grad()
def test_an_actor_at_another_input_size_prunes_by_its_grid_read_as_fractions(size):
    """The actor built for 16 patches at 9 or 36: removals come from its grid scaled to the input
    (Actor.grid), the decisions replay to the per-image reference and do not depend on the batch."""
    name, kw = DYNAMIC
    model = make_model(name, **kw)
    n0 = (size // 16) ** 2
    x = torch.randn(5, 3, size, size, generator=torch.Generator().manual_seed(size))
    actor = half_open_actor(model, x)
    assert actor.num_patches == 16
    stats = _replay_and_batch_independence(model, actor, x)
    assert stats.gate.any() and set(stats.removed[stats.gate].tolist()) <= set(actor.grid(n0).tolist())
    assert (stats.tokens >= actor.min_keep).all()


def test_a_fixed_model_built_for_another_size_takes_the_actor():
    """A model created at 96 px (36 patches) wraps with an actor trained at 64 px (16 patches)."""
    small = make_model("deit_tiny_patch16_224", img_size=64)
    large = make_model("deit_tiny_patch16_224", img_size=96)
    actor = half_open_actor(small, images(small, 4))
    timm_dora.wrap(large, actor)
    with torch.no_grad():
        large(images(large, 4))
    assert set(large.dora_stats.removed[large.dora_stats.gate].tolist()) <= set(actor.grid(36).tolist())


# --------------------------------------------------------------------------------------------
# skip_dead: the last block's MLP only on the rows a CLS-token readout reads


@pytest.mark.parametrize("family", ["deit", "deit_distilled", "vit_augreg", "dinov2_registers"])
@torch.no_grad()
def test_skip_dead_gives_the_same_logits_for_the_last_mlp_on_the_prefix_rows_only(family):
    name, kw = SMALL_FAMILIES[family]
    model = make_model(name, **kw)
    x = images(model, 4)
    p, depth = model.num_prefix_tokens, len(model.blocks)
    mlp = sum(m.in_features * m.out_features for m in model.blocks[-1].mlp.modules() if isinstance(m, torch.nn.Linear))
    plan = random_plan(4, model.patch_embed.num_patches, depth, [1, depth // 2, depth - 1], seed=3)
    for policy in (NoPrune(), ReplayPolicy(plan), timm_dora.ActorPolicy(half_open_actor(model, x))):
        timm_dora.wrap(model, policy=policy)
        ref, ref_stats = model(x), model.dora_stats
        timm_dora.unwrap(model)
        timm_dora.wrap(model, policy=policy, skip_dead=True)
        out, stats = model(x), model.dora_stats
        timm_dora.unwrap(model)
        assert (out - ref).abs().max().item() <= 1e-5
        actor = isinstance(policy, timm_dora.ActorPolicy)  # (the actor decides nothing at the dead block)
        for name_ in ("tokens", "gate", "removed"):
            a, b = getattr(stats, name_), getattr(ref_stats, name_)
            assert torch.equal(a[:, :-1], b[:, :-1]) and (torch.equal(a, b) or actor), name_
        if actor:
            assert not stats.gate[:, -1].any() and (stats.removed[:, -1] == 0).all()
            assert (stats.policy_gflops < ref_stats.policy_gflops).all()  # no gate at the last block
        else:
            assert torch.equal(stats.policy_gflops, ref_stats.policy_gflops)
        # the MLP of the last block no longer runs on the visual tokens surviving it: 2 * mlp MACs each
        saved = 2 * mlp * ref_stats.tokens[:, -1].double() / 1e9 + (ref_stats.policy_gflops - stats.policy_gflops)
        assert torch.allclose(ref_stats.gflops - stats.gflops, saved, rtol=0, atol=1e-12)
    native = model(x)
    assert timm_dora.native_gflops(model) - timm_dora.native_gflops(model, skip_dead=True) == pytest.approx(
        2 * mlp * model.patch_embed.num_patches / 1e9, abs=1e-12)
    from timm_dora.evaluate import native_forward

    assert (native_forward(model, x, skip_dead=True) - native).abs().max().item() <= 1e-5


def test_skip_dead_refuses_readouts_that_read_every_token_and_graphs():
    model = make_model(*SMALL_FAMILIES["vit_avgpool"][:1], **SMALL_FAMILIES["vit_avgpool"][1])
    with pytest.raises(ValueError, match="this readout .*global_pool='avg'.* reads every token"):
        timm_dora.wrap(model, policy=NoPrune(), skip_dead=True)
    deit = make_model(*SMALL_FAMILIES["deit"][:1], **SMALL_FAMILIES["deit"][1])
    with pytest.raises(ValueError, match="not captured in CUDA graphs yet"):
        timm_dora.wrap(deit, Actor.for_model(deit), skip_dead=True, cuda_graphs=True)
    assert not timm_dora.is_wrapped(deit) and not timm_dora.is_wrapped(model)
