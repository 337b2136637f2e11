"""The MLP's first layer and GELU in one Triton kernel (``timm_dora.engine.mlp_kernel``,
``EngineOptions.fused_gelu``): in Triton's interpreter against ``F.gelu(F.linear(...))`` (float32,
shapes off the tiles, with and without a bias, several tiles), which modules it takes, its errors,
and on CUDA in bf16 against timm's ``Mlp`` and inside a wrapped forward."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import engine_options  # noqa: F401 (fixture)
from helpers import run_interpreted, triton_version
from timm_dora.engine import mlp_kernel

pytest.importorskip("triton")

INTERPRETED = r"""
import json, torch
import torch.nn.functional as F
from timm_dora.engine.mlp_kernel import linear_gelu

g = torch.Generator().manual_seed(0)
out = {}
for name, m, k, n, bias, tile in (("one_tile", 5, 24, 40, True, None),
                                  ("tiles", 70, 48, 96, True, (32, 32, 16, 4, 1, 2)),
                                  ("no_bias", 33, 20, 17, False, (16, 16, 16, 4, 1, 8))):
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    x_view = torch.randn(m, k + 8, generator=g)[:, 3:3 + k]  # rows of another stride
    x_view.copy_(x)
    ref = F.gelu(F.linear(x, w, b))
    got = linear_gelu(x, w, b, tile=tile)
    got_view = linear_gelu(x_view, w, b, tile=tile)
    out[name] = {"max_abs_diff": float((got - ref).abs().max()), "view_equal": torch.equal(got, got_view),
                 "shape": list(got.shape), "negative": bool((ref < 0).any())}
print(json.dumps(out))
"""


@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton's interpreter before 3.9 cannot run these kernels")
def test_interpreted_linear_gelu_equals_linear_then_gelu():
    res = run_interpreted(INTERPRETED, timeout=300)
    assert set(res) == {"one_tile", "tiles", "no_bias"}
    for name, case in res.items():
        assert case["max_abs_diff"] < 1e-5, (name, case)
        assert case["view_equal"] and case["negative"]  # (GELU's negative side reached)
    assert res["tiles"]["shape"] == [70, 96] and res["no_bias"]["shape"] == [33, 17]


def test_which_mlps_it_takes_and_its_errors(engine_options):
    from timm.layers import Mlp

    x = torch.zeros(4, 8)
    exact, tanh = Mlp(8, 16), Mlp(8, 16, act_layer=lambda: nn.GELU(approximate="tanh"))
    engine_options(fused_gelu=True)
    # only on CUDA in half precision: here, on the CPU, every module runs itself
    assert not mlp_kernel.fused_gelu_applies(exact, x)
    assert torch.equal(mlp_kernel.mlp_forward(exact, x), exact(x))
    if torch.cuda.is_available():
        half = exact.cuda().half()
        assert mlp_kernel.fused_gelu_applies(half, x.cuda().half())
        assert not mlp_kernel.fused_gelu_applies(tanh.cuda().half(), x.cuda().half())
        rows = torch.zeros(mlp_kernel.MAX_ROWS + 1, 8, device="cuda", dtype=torch.half)
        assert mlp_kernel.fused_gelu_applies(half, rows[:-1]) and not mlp_kernel.fused_gelu_applies(half, rows)
        engine_options(fused_gelu=False)
        assert not mlp_kernel.fused_gelu_applies(half, x.cuda().half())
    with pytest.raises(ValueError, match=r"linear_gelu: x \[rows, in\] \(unit column stride\), weight \[out, in\] "
                                         r"contiguous and bias \[out\] of one dtype expected"):
        mlp_kernel.linear_gelu(x, torch.zeros(16, 4))


def test_tile_for_takes_the_first_bound_that_holds():
    (first, small), (second, larger) = mlp_kernel.TILES[:2]
    assert mlp_kernel.tile_for(1) == mlp_kernel.tile_for(first) == small
    assert mlp_kernel.tile_for(first + 1) == larger
    assert mlp_kernel.tile_for(10 ** 9) == mlp_kernel.TILES[-1][1]
    assert all(len(tile) == 6 for _, tile in mlp_kernel.TILES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_gelu_matches_timm_mlp_and_the_wrapped_forward(engine_options):
    """bf16: the kernel's products sum in another order than cuBLAS's, so values agree to rounding
    (the GELU's own arithmetic is the same); a wrapped forward with it gives the same decisions."""
    import timm
    import timm_dora
    from timm.layers import Mlp

    torch.manual_seed(0)
    mlp = Mlp(192, 768).cuda().to(torch.bfloat16).eval()
    engine_options(fused_gelu=True)
    for rows in (1, 197, 3152, 63040):
        x = torch.randn(rows, 192, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            ref = mlp(x)
            got = mlp_kernel.mlp_forward(mlp, x)
            hidden = mlp_kernel.linear_gelu(x, mlp.fc1.weight, mlp.fc1.bias)
        torch.testing.assert_close(hidden.float(), F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)).float(),
                                   rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
    # in the engine's forward (no pruning: the same rows either way), captured and replayed
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False).cuda().to(torch.bfloat16).eval()
    images = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    runs, used = {}, []
    forward = mlp_kernel.linear_gelu
    mlp_kernel.linear_gelu = lambda *a, **k: (used.append(1), forward(*a, **k))[1]
    try:
        for on in (False, True):
            engine_options(fused_gelu=on)
            timm_dora.wrap(model, policy=timm_dora.NoPrune())
            with torch.inference_mode():
                runs[on] = [model(images).float() for _ in range(3)]
            timm_dora.unwrap(model)
            assert bool(used) == on
    finally:
        mlp_kernel.linear_gelu = forward
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
