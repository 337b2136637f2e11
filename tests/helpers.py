"""Shared test helpers: small timm models and an independent per-image reference forward."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, List

import huggingface_hub.constants
import pytest
import timm
import torch

# replay plans drawn for or recorded from a policy, and the forced actor: shared with the benchmarks
from benchmarks.common import Recorder, gate_forced_actor, random_plan, recorded_plan  # noqa: F401

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
# tests on the real backbones and images of ../shared (absent on the GPU machine and elsewhere)
needs_shared = pytest.mark.skipif(not (SHARED / "weights").is_dir() or not (SHARED / "data" / "imagenet-mini").is_dir(),
                                  reason="../shared (real weights and images) not present")

# (timm name, create_model kwargs): small variants of every supported family, random weights.
SMALL_FAMILIES = {
    "deit": ("deit_tiny_patch16_224", dict(img_size=64)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=64)),
    "vit_augreg": ("vit_tiny_patch16_224", dict(img_size=64)),
    "vit_avgpool": ("vit_tiny_patch16_224", dict(img_size=64, global_pool="avg")),
    "dinov2_layerscale": ("vit_small_patch14_dinov2", dict(img_size=56)),
    "dinov2_registers": ("vit_small_patch14_reg4_dinov2", dict(img_size=56)),
    # no class token: global average pooling, with registers, and an attention-pool (MAP) head
    "vit_gap": ("vit_base_patch16_gap_224", dict(img_size=64, embed_dim=192, num_heads=3)),
    "vit_reg4_gap": ("vit_little_patch16_reg4_gap_256", dict(img_size=64)),
    "siglip_map": ("vit_base_patch16_siglip_224", dict(img_size=64, embed_dim=192, num_heads=3)),
}
# The paper's backbones at full width and depth (random weights); a small image keeps CPU tests fast.
FULL_FAMILIES = {
    "deit_b16": ("deit_base_patch16_224", dict(img_size=64)),
    "vit_b16": ("vit_base_patch16_224", dict(img_size=64)),
    "vit_l16": ("vit_large_patch16_224", dict(img_size=64)),
    "dinov2_b14": ("vit_base_patch14_dinov2", dict(img_size=56)),
}


# torch.utils.flop_counter counts these ops with the same formula in every torch release we support
# (2 * M * N * K for a product, 2 * MACs for a convolution). Its attention entries are not stable: on
# the CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, which torch <= 2.14 does not
# register (counted as 0 FLOPs) and torch 2.15 does. The FLOP tests therefore compare our accounting
# with hand-computed formulas first, and with the counter only on these ops (plus SDPA where counted).
STABLE_COUNTER_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution"})
SDPA_COUNTER_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
})


def counter_flops(fc) -> tuple:
    """``(products, attention)`` of a finished ``FlopCounterMode``: the FLOPs it gave the
    :data:`STABLE_COUNTER_OPS`, and those it gave SDPA (``None`` where this torch does not count
    SDPA). Any other op counted is an error: the tests name every op they rely on."""
    counts = {str(op): int(n) for op, n in fc.get_flop_counts()["Global"].items()}
    unknown = set(counts) - STABLE_COUNTER_OPS - SDPA_COUNTER_OPS
    assert not unknown, f"the counter counted ops these tests do not know: {sorted(unknown)}"
    products = sum(n for op, n in counts.items() if op in STABLE_COUNTER_OPS)
    attention = sum(n for op, n in counts.items() if op in SDPA_COUNTER_OPS)
    return products, (attention if attention else None)


def assert_counter_agrees(fc, products: int, attention: int) -> None:
    """A finished ``FlopCounterMode`` agrees with hand-computed MACs: exactly ``products`` (linear
    layers, convolutions and other matrix products) plus either exactly ``attention`` (the
    ``QK^T`` and ``AV`` matmuls, whether counted as an SDPA op or as the ``bmm`` of SDPA's math
    path) or none of it (a torch that does not register the CPU SDPA op)."""
    stable, sdpa = counter_flops(fc)
    counted = stable + (sdpa or 0)
    assert counted in (2 * products, 2 * (products + attention)), (counted, 2 * products, 2 * attention)


def hand_vit_macs(dims: dict, blocks) -> tuple:
    """App. E.4 by hand for a plain pre-norm ViT: ``(products, attention)`` MACs of one image.

    ``dims``: ``d`` (width), ``hidden`` (MLP), ``patch`` (side), ``patches``, ``classes``, ``heads``
    (classifier heads: 2 with a distillation head). ``blocks``: ``(tokens in attention, tokens in
    the MLP)`` per block, prefix tokens included. Products: the patch convolution, QKV and the output
    projection on the attention tokens, the MLP's two layers on the MLP tokens, the classifier;
    attention: ``QK^T`` and ``AV``, ``n * n * d`` each."""
    d = dims["d"]
    products = dims["patches"] * d * 3 * dims["patch"] ** 2 + dims["heads"] * d * dims["classes"]
    attention = 0
    for n_attn, n_mlp in blocks:
        products += n_attn * (3 * d * d + d * d) + n_mlp * 2 * d * dims["hidden"]
        attention += 2 * n_attn * n_attn * d
    return products, attention


def make_model(name: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=kwargs.pop("num_classes", 10), **kwargs).eval()
    # timm inits LayerScale at 1e-5 and some heads at zero; randomise so that every term matters
    # (scaled so that logits are O(1): the equivalence tolerance of 1e-5 is absolute)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".gamma") or "norm" in n:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if ("norm" in n and n.endswith("weight")) else 0.0))
            elif n.startswith("head") and n.endswith("weight"):
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model


def images(model, batch: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = model.patch_embed.img_size
    return torch.randn(batch, 3, size[0], size[1], generator=g)


def assert_batch_independent(forward, model, x: torch.Tensor, tol: float = 1e-5) -> None:
    """``forward(images) -> logits`` reduces tokens (its logits differ from native on ``x``), and
    each image's logits do not depend on the batch: alone, and beside other images."""
    with torch.no_grad():
        out = forward(x)
        assert not torch.allclose(out, model(x), atol=1e-3)  # something was reduced
        for i in range(x.shape[0]):
            assert (out[i] - forward(x[i:i + 1])[0]).abs().max() < tol, i
        other = torch.cat([x[:1], images(model, 2, seed=7)])
        assert (forward(other)[0] - out[0]).abs().max() < tol


def assert_same_forwards(got, ref, atol: float = 0.0) -> None:
    """Two runs' ``[(logits, DoraStats), ...]``: the same decisions (tokens, gates, removals) and
    logits equal, or within ``atol`` where given (a fold's float32 sums may add in another order)."""
    for (oa, sa), (ob, sb) in zip(got, ref, strict=True):
        for field in ("tokens", "gate", "removed"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        if atol:
            torch.testing.assert_close(oa.float(), ob.float(), rtol=0, atol=atol)
        else:
            assert torch.equal(oa, ob)


def plan_for_image(plan, i: int) -> Dict[int, List[int]]:
    return {l: col[img == i].tolist() for l, (img, col) in plan.items()}


@torch.no_grad()
def reference_forward(model, img: torch.Tensor, deletions: Dict[int, List[int]], readout: str = "model") -> torch.Tensor:
    """One image, timm's own Attention/Mlp/head forwards, rows deleted by Python indexing.

    Independent of timm_dora's packing: ``deletions[l]`` lists the visual columns (0-based among
    the image's current visual tokens) removed after block ``l``'s attention residual.
    """
    p = model.num_prefix_tokens
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(img))))
    for l, blk in enumerate(model.blocks):
        x = x + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x))))
        gone = set(deletions.get(l, []))
        if gone:
            keep = [j for j in range(x.shape[1]) if j < p or (j - p) not in gone]
            x = x[:, keep]
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    x = model.norm(x)
    if readout == "lc1":
        return model.head(torch.cat([x[:, 0], x[:, p:].mean(1)], dim=-1))
    return model.forward_head(x)


def hub_cache(cache_dir, repo_id, commits, refs):
    """Lay folders out as huggingface_hub's cache does: blobs by hash, snapshot symlinks, refs."""
    root = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    for commit, folder in commits.items():
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(Path(folder).iterdir()):
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir()
    for ref, commit in refs.items():
        (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return root


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1; huggingface_hub reads it at import, so patch its constant as well."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert huggingface_hub.constants.is_offline_mode()


def kind_actor(model, kind: str):
    """A random-weight actor for ``model`` whose gate is ``"closed"`` everywhere, ``"biased"``
    (opens on some images and blocks) or ``"forced"`` open at blocks 1, 4 and 7."""
    from timm_dora import Actor

    torch.manual_seed(3)
    if kind == "forced":
        return gate_forced_actor(model, [1, 4, 7])
    actor = Actor.for_model(model)
    with torch.no_grad():
        actor.gate_mlp[2].bias.fill_(-1e4 if kind == "closed" else 0.0)  # 0: opens on some images/blocks
    return actor


@torch.no_grad()
def half_open_actor(model, x, seed: int = 3):
    """A random-weight actor whose gate logit, on ``x`` with nothing removed, is positive for about
    half of the (image, block) pairs: its last gate bias set to minus the median of the others."""
    import timm_dora
    from timm_dora import Actor, ActorPolicy

    torch.manual_seed(seed)
    actor = Actor.for_model(model)
    actor.gate_mlp[2].bias.fill_(-1e4)  # closed: every block sees every token, logits recorded
    policy = ActorPolicy(actor, record=True)
    timm_dora.wrap(model, policy=policy)
    try:
        model(x)
    finally:
        timm_dora.unwrap(model)
    logits = torch.stack([r.gate_logit for r in policy.records]) + 1e4
    actor.gate_mlp[2].bias.fill_(-float(logits.median()))
    return actor


def triton_version() -> tuple:
    """``(major, minor)`` of the installed Triton."""
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def run_interpreted(script: str, timeout: int) -> dict:
    """Run ``script`` in a subprocess with Triton's interpreter (``TRITON_INTERPRET=1`` must be set
    before a kernel is defined) and return the JSON object its last output line prints."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def capture_graph(fn):
    """``fn`` warmed up on a side stream, then captured as a CUDA graph: ``(graph, fn's output in
    the graph's memory)``; replay the graph to recompute that output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.fixture
def engine_options():
    """``engine_options(rows_bucket=1, ...)`` changes the active
    :class:`~timm_dora.engine.options.EngineOptions` for the rest of the test (cumulatively): what
    the engine's functions read, and what every model wrapped without options runs with."""
    import contextlib
    import dataclasses

    from timm_dora.engine.options import active, using

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(using(dataclasses.replace(active(), **changes)))


def spy_sdpa(monkeypatch) -> List[tuple]:
    """Record every ``F.scaled_dot_product_attention`` call from now on (the real one still runs):
    ``(query length, attn_mask, other keyword arguments)`` per call."""
    import torch.nn.functional as F

    calls: List[tuple] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[2], attn_mask, kw))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls
