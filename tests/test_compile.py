"""``torch.compile`` of a wrapped model (#30, CPU, fp32): the compiled model's outputs and pruning
decisions equal the eager wrapped model's, for the actor and for a ragged replayed batch (the
packed varlen attention path), with Dynamo's eager backend and with Inductor. Three blocks are
enough for every path (a pruned block, a ragged one, a host read per block) and keep Inductor's
CPU compiles short; ``mode="reduce-overhead"`` differs from Inductor's default only by CUDA graphs,
so it is not compiled again on the CPU."""
import pytest
import torch

import timm_dora
from timm_dora.policy import ReplayPolicy

from helpers import make_model, random_plan


@pytest.mark.parametrize("policy", ["replay", "actor"])
def test_compiled_wrapped_model_equals_eager(policy):
    model = make_model("deit_tiny_patch16_224", img_size=64, depth=3)
    n0 = model.patch_embed.num_patches
    x = torch.randn(5, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    if policy == "replay":  # varied per image: the batch is ragged from block 2 on, so varlen attention runs
        timm_dora.wrap(model, policy=ReplayPolicy(random_plan(5, n0, len(model.blocks), [1, 2], seed=3)))
    else:
        torch.manual_seed(2)
        timm_dora.wrap(model, timm_dora.Actor.for_model(model))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        removed = model.dora_stats.removed.clone()
        if policy == "replay":
            assert len(set(map(tuple, removed.tolist()))) > 1  # not one count for every image
        for options in (dict(backend="eager"), dict(backend="inductor")):
            torch._dynamo.reset()
            out = torch.compile(model, **options)(x)
            assert torch.equal(model.dora_stats.removed, removed)
            torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def test_compiled_forward_breaks_only_where_the_host_reads():
    """Dynamo splits a compiled wrapped forward where the eager executor reads decisions on the host
    (the gate, the new lengths), not at the engine's lazily computed layout values (a
    ``functools.cached_property`` takes a lock on Python 3.11 that Dynamo cannot trace)."""
    model = make_model("deit_tiny_patch16_224", img_size=64, depth=3)
    torch.manual_seed(2)
    timm_dora.wrap(model, timm_dora.Actor.for_model(model))
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(5, 3, 64, 64))
    reasons = [b.reason for b in explained.break_reasons]
    assert reasons  # the host reads do break the graph
    assert not [r for r in reasons if "context manager" in r.lower()]
