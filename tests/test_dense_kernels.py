"""The dense kernels of the block program on CUDA (``timm_dora.engine.dense_kernels``, #30): the
Triton LayerNorm against ``torch.nn.functional.layer_norm`` (in Triton's interpreter on the CPU, in
bf16 on CUDA), the patch embedding as one matrix product against timm's convolution, and the
fallback to the module itself wherever the fast form does not apply."""
import pytest
import torch
import torch.nn as nn

from helpers import make_model, run_interpreted
from timm_dora.engine import dense_kernels
from timm_dora.engine.dense_kernels import layer_norm, patch_embed, patch_embed_gemm
from timm_dora.engine.options import EngineOptions, using

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

INTERPRETED = r"""
import json
import torch
import torch.nn.functional as F
from timm_dora.engine.dense_kernels import layer_norm_triton

torch.manual_seed(0)
out = {}
for rows, n in ((37, 192), (5, 768), (3, 100)):  # several rows per program, the last one partial; a width
    # that is no power of two
    x = torch.randn(rows, n) * 3 + 1
    w, b = torch.randn(n), torch.randn(n)
    wide = torch.randn(rows, n + 8)[:, :n]  # rows with a stride of their own
    wide.copy_(x)
    ref = F.layer_norm(x, (n,), w, b, 1e-6)
    out[f"{rows}x{n}"] = [float((layer_norm_triton(t, w, b, 1e-6) - ref).abs().max()) for t in (x, wide)]
print(json.dumps(out))
"""


INTERPRETED_EMBED = r"""
import json
import timm
import torch
from timm_dora.engine.dense_kernels import patch_rows, patch_rows_triton, position_tokens_triton

torch.manual_seed(0)
rows = {}
# (a channel count, patch and image sizes that are no powers of two; an image cropped by a view)
for name, x, ph, pw in (("3x64x64/16", torch.randn(2, 3, 64, 64), 16, 16),
                        ("3x28x42/14", torch.randn(1, 3, 28, 42), 14, 14),
                        ("2x20x24/4x8", torch.randn(2, 2, 20, 24), 4, 8),
                        ("view", torch.randn(2, 3, 72, 64)[:, :, 4:68], 16, 16)):
    rows[name] = bool(torch.equal(patch_rows_triton(x, ph, pw), patch_rows(x, ph, pw)))
tokens = {}
for name, kw in (("cls", {}), ("cls+reg", dict(reg_tokens=2)), ("no_embed_class", dict(no_embed_class=True, reg_tokens=3)),
                 ("gap", dict(class_token=False, global_pool="avg")), ("no_pos", dict(pos_embed="none"))):
    for dtype in (torch.float32, torch.float16):
        m = timm.create_model("vit_tiny_patch16_224", img_size=64, **kw).eval().to(dtype)
        with torch.no_grad():
            for t in (m.cls_token, m.reg_token, m.pos_embed):
                if t is not None:
                    t.normal_()
            x = torch.randn(3, 16, 192).to(dtype)
            x[0, :4, :5] = -0.0  # (a negative zero is kept where nothing is added to it)
            ref = m._pos_embed(x)
            out = torch.full((ref.numel(),), 7.0, dtype=dtype)
            position_tokens_triton(x, m.cls_token, m.reg_token, m.pos_embed, not m.no_embed_class, out)
            tokens[f"{name}/{dtype}"] = bool(torch.equal(out.view(ref.shape), ref)
                                             and torch.equal(out.view(ref.shape).signbit(), ref.signbit()))
print(json.dumps({"rows": rows, "tokens": tokens}))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernels' cases in one interpreter subprocess (its start costs more than the cases)."""
    pytest.importorskip("triton")
    script = (INTERPRETED.replace("print(json.dumps(out))", "plain = out")
              + INTERPRETED_ADD.replace("print(json.dumps(out))", "added = out")
              + INTERPRETED_EMBED.replace('print(json.dumps({"rows": rows, "tokens": tokens}))',
                                          'print(json.dumps({"plain": plain, "add": added, "rows": rows, "tokens": tokens}))'))
    return run_interpreted(script, timeout=300)


def test_interpreted_patch_rows_lay_out_each_patch_as_the_permutation_does(interpreted):
    """The Triton copy that lays an image's patches out as rows, bit for bit the reshape and
    permutation's, at patch and image sizes that are no powers of two and from a strided view."""
    assert interpreted["rows"] == {"3x64x64/16": True, "3x28x42/14": True, "2x20x24/4x8": True, "view": True}


def test_interpreted_position_tokens_equal_timms_pos_embed(interpreted):
    """The one-kernel token embedding equals timm's ``_pos_embed`` bit for bit: class and register
    tokens, the position embedding over the prefix or not (``no_embed_class``), no class token,
    no position embedding; in fp32 and fp16 (the sum rounded once, as torch's add rounds)."""
    res = interpreted["tokens"]
    assert len(res) == 10 and all(res.values()), res


def test_interpreted_layer_norm_matches_torch(interpreted):
    res = interpreted["plain"]
    assert set(res) == {"37x192", "5x768", "3x100"}
    for diffs in res.values():
        assert max(diffs) < 1e-5, res


INTERPRETED_ADD = r"""
import json
import torch
import torch.nn.functional as F
from timm_dora.engine.dense_kernels import add_layer_norm_triton

torch.manual_seed(0)
out = {}
# (not bf16: the interpreter rounds bf16 toward zero where CUDA rounds to nearest even; the CUDA
# test checks the bf16 sum)
for rows, n, dtype in ((37, 192, torch.float32), (5, 768, torch.float16), (3, 100, torch.float16)):
    x = (torch.randn(rows, n) * 3 + 1).to(dtype)
    d = torch.randn(rows, n + 8)[:, :n].to(dtype)  # a branch with a row stride of its own
    w, b = torch.randn(n), torch.randn(n)
    s, y = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    add_layer_norm_triton(x, d, w, b, 1e-6, s, y)
    ref_s = x + d  # rounded to the dtype, as the kernel must round it before normalising
    ref_y = F.layer_norm(ref_s.float(), (n,), w, b, 1e-6).to(dtype)
    inplace = x.clone()  # out = x: each row read before it is written
    add_layer_norm_triton(inplace, d, w, b, 1e-6, inplace, torch.empty_like(x))
    out[f"{rows}x{n}"] = [bool(torch.equal(s, ref_s)), float((y.float() - ref_y.float()).abs().max()),
                          float(ref_y.float().abs().max()), bool(torch.equal(inplace, ref_s))]
print(json.dumps(out))
"""


def test_interpreted_add_layer_norm_is_the_sum_then_the_norm(interpreted):
    """The fused residual sum and LayerNorm: the sum exactly torch.add's (rounded to the dtype),
    the norm of that rounded sum within a rounding of F.layer_norm's, in place too."""
    res = interpreted["add"]
    assert set(res) == {"37x192", "5x768", "3x100"}
    for name, (sum_equal, diff, scale, inplace_equal) in res.items():
        assert sum_equal and inplace_equal, name
        assert diff <= (1e-5 if name == "37x192" else 0.01 * scale), (name, diff)


def test_add_layer_norm_off_cuda_runs_the_two_operations():
    """Where the kernel does not apply (the CPU here) the sum and the module's norm run as they are."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(24)
    x, d = torch.randn(6, 24), torch.randn(6, 24)
    out, normed = torch.empty(6, 24), torch.empty(6, 24)
    dense_kernels.add_layer_norm(x, d, norm, out, normed)
    assert torch.equal(out, x + d) and torch.equal(normed, norm(x + d))


def test_patch_embedding_as_one_matrix_product_equals_timms_convolution():
    torch.manual_seed(0)
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        ref = model.patch_embed(x)
        got = patch_embed_gemm(model.patch_embed.proj, x)
    assert got.shape == ref.shape == (3, 16, 192)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_off_cuda_and_in_fp32_the_modules_run_themselves():
    """The fast forms only on CUDA in half precision: elsewhere the module's own output, bit for bit."""
    torch.manual_seed(0)
    model = make_model("deit_tiny_patch16_224", img_size=64)
    x = torch.randn(2, 3, 64, 64)
    norm = model.blocks[0].norm1
    rows = torch.randn(10, 192)
    with torch.no_grad():
        assert torch.equal(patch_embed(model.patch_embed, x), model.patch_embed(x))
        assert torch.equal(layer_norm(norm, rows), norm(rows))
        assert torch.equal(layer_norm(nn.Identity(), rows), rows)


def test_timms_layer_norms_are_the_plain_ones():
    """Every norm of timm's ViT blocks is a LayerNorm whose forward is ``F.layer_norm`` (the kind
    the Triton kernel replaces); a subclass with a forward of its own is not."""
    model = make_model("vit_tiny_patch16_224", img_size=64)
    norms = [model.norm] + [n for blk in model.blocks for n in (blk.norm1, blk.norm2)]
    assert all(type(n).forward in dense_kernels._PLAIN_LAYER_NORMS for n in norms)

    class Scaled(nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    assert Scaled.forward not in dense_kernels._PLAIN_LAYER_NORMS


@cuda
def test_on_cuda_the_fast_kernels_give_the_modules_values(monkeypatch):
    calls = []
    monkeypatch.setattr(dense_kernels, "layer_norm_triton",
                        lambda *a, f=dense_kernels.layer_norm_triton: calls.append(1) or f(*a))
    torch.manual_seed(0)
    model = make_model("deit_tiny_patch16_224", img_size=64).to("cuda", torch.bfloat16)
    x = torch.randn(5, 3, 64, 64, device="cuda").to(torch.bfloat16)
    rows = torch.randn(1000, 192, device="cuda").to(torch.bfloat16) * 4
    norm = model.blocks[0].norm1
    with torch.inference_mode():
        torch.testing.assert_close(layer_norm(norm, rows), norm(rows), rtol=0.02, atol=0.02)
        torch.testing.assert_close(patch_embed(model.patch_embed, x), model.patch_embed(x), rtol=0.02, atol=0.02)
        assert calls == [1]  # the kernel ran
        out, normed = torch.empty_like(rows), torch.empty_like(rows)
        branch = torch.randn_like(rows)
        dense_kernels.add_layer_norm(rows, branch, norm, out, normed)  # (the fused kernel)
        assert torch.equal(out, rows + branch)
        torch.testing.assert_close(normed, norm(rows + branch), rtol=0.02, atol=0.02)
        with using(EngineOptions(dense_kernels=False)):
            assert torch.equal(layer_norm(norm, rows), norm(rows))


@cuda
def test_on_cuda_the_embedding_into_a_buffer_is_timms_bit_for_bit():
    """``blocks.embed(..., out=)``: the patch rows' kernel, the matrix product and the position
    tokens' kernel give timm's embedding (the product's rounding apart: compared with the same
    product then timm's ``_pos_embed``), and where the kernel does not apply (position dropout in
    training mode) timm's modules run."""
    from timm_dora.engine.blocks import embed
    torch.manual_seed(0)
    model = make_model("vit_tiny_patch16_224", img_size=64, reg_tokens=2).to("cuda", torch.bfloat16)
    x = torch.randn(5, 3, 64, 64, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        patches = patch_embed(model.patch_embed, x)
        torch.testing.assert_close(patches, model.patch_embed(x), rtol=0.02, atol=0.02)
        ref = model._pos_embed(patches)
        out = torch.full((ref.numel(),), 7.0, dtype=torch.bfloat16, device="cuda")
        assert embed(model, x, out=out) is out
        assert torch.equal(out.view(ref.shape), ref)
        assert dense_kernels.position_tokens(model, patches, out)
        model.pos_drop.p = 0.5
        model.train()
        assert not dense_kernels.position_tokens(model, patches, out)
