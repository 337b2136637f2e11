"""V-Pruner (Yao et al., AAAI 2026), an offline token-mask search, as a baseline on a frozen timm ViT.

What is known of the method, and what this module implements from it. V-Pruner's paper ("V-Pruner: A
Fast and Globally-informed Token Pruning Framework for Vision Transformer") was not available to us
beyond its abstract and its AAAI talk summary; no code of the authors was found, nothing was copied.
The abstract: Fisher information gives an initial assessment of token importance, "a principled
initial prior for pruning decisions"; PPO then refines the pruning "into a global sequential
decision process" with a composite reward of model performance and computational cost; the talk
summary names three stages, *token mask search* (Fisher), *token mask rearrangement* (the RL stage,
over the interactions among mask variables) and *token mask tuning*. The DORA paper uses it as
"PPO with a Fisher-information prior, but as an offline search for a mask shared across inputs":
"V-Pruner's offline mask search is repeated independently for each backbone and budget; its exported
mask is fixed across images and applied before the first block. Offline search is excluded from
deployment measurements"; at inference it runs FlashAttention. That reading is what is built here.

**Inference** (:func:`vpruner_forward`): a binary mask over the ``N`` patch positions with exactly
``K`` kept, the same for every image. The model's own embedding runs (``patch_embed``,
``_pos_embed``, ``patch_drop``, ``norm_pre``: :func:`timm_dora.engine.blocks.embed`), the ``N - K``
masked visual tokens are deleted (one fixed-index gather; prefix tokens, i.e. CLS, distillation
token and registers, always kept), and the rest of timm's forward runs unchanged on ``P + K``
tokens: ``model.blocks`` (timm's own ``Block.forward``, fused SDPA: FlashAttention on CUDA), the
final ``norm`` and ``forward_head`` (CLS token, or average pooling over the kept tokens, or a MAP
head on them). An all-kept mask is the native forward exactly. ``skip_dead``: the last block's MLP
on the prefix tokens only, as for the other baselines.

**GFLOPs** (App. E.4 rule, :mod:`timm_dora.engine.flops`): the patch embedding of all ``N`` patches
(deletion comes after it), every block on ``P + K`` tokens (attention projections, the two attention
matmuls, the MLP; the last MLP on ``P`` tokens with ``skip_dead``), the classifier (a MAP head's
per-token part on ``P + K``). The mask costs nothing online (a gather); the offline search is not
counted, as in the DORA paper, and is reported in the mask file instead.

**Search** (:func:`search_mask`, per backbone and per ``K``, on the pool's ``rollout`` images only):

1. *Fisher prior.* Each visual position ``i`` carries a mask variable ``m_i`` multiplying its
   embedded token (``m = 1``: unpruned). Its Fisher information on the search images is
   ``F_i = E_x[(dL/dm_i)^2]`` with ``dL/dm_i = <dL/dx_i, x_i>`` (one backward pass per image batch),
   ``L`` the cross-entropy of the logits to the native model's own top-1 class (label-free, our
   choice; V-Pruner's abstract does not say which loss). ``prior="embedding"`` uses instead
   ``E_x[sum_c (dL/dx_ic)^2]``, the Fisher trace of the token's embedding. The prior logits are
   ``theta0 = prior_scale * standardise(log F)``; the prior-only mask keeps the top-``K`` of ``F``.
2. *PPO over masks.* The policy is a Plackett-Luce distribution over positions with logits
   ``theta`` (initialised at ``theta0``): a mask is drawn as the sequence of ``N - K`` positions to
   delete, each drawn without replacement with probability ``softmax(-theta)`` over those left
   (Gumbel-top-k); exactly ``K`` are kept, so the budget is exact and the composite reward's cost
   term is the same for every mask (it drops out). The reward of a mask is ``-KL(native || masked)``
   of the frozen model's class distributions, averaged over a minibatch of search images shared by
   all the masks of an iteration (common images: the comparison between masks is paired). The
   advantage is the reward standardised within the iteration (a one-step problem: no critic);
   ``ppo_epochs`` clipped-ratio updates (``clip``) with Adam on ``theta``, plus an L2 pull
   ``prior_weight * mean((theta - theta0)^2)`` toward the prior.
3. *Export.* The policy's mode (the ``K`` largest ``theta``) and the prior-only mask are scored on
   held-out search images (``eval_images`` of the rollout split that PPO never drew) and the better
   one is exported (the file says which, with both scores).

Where V-Pruner is silent or we chose (documented, tested): the single mask before block 0 (the DORA
paper's reading; the talk summary's per-layer mask variables are not used); no *mask tuning* stage
(rescaling kept tokens would change the tokens, and the DORA paper exports a binary mask); the
loss of the Fisher prior (above); the policy form (Plackett-Luce for an exact budget) and every
hyperparameter (:class:`SearchConfig`); the KL reward; the export rule. The search batches images
through timm's blocks on precomputed token embeddings (the embedding is computed once per image).
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine.blocks import embed, mlp_residual
from ...engine.flops import backbone_cost
from ...engine.patch import check_skip_dead, check_supported
from .tome import head

__all__ = [
    "PRIORS",
    "SearchConfig",
    "SearchPool",
    "SearchResult",
    "VPruner",
    "VPrunerCost",
    "VPrunerMask",
    "architecture",
    "build_pool",
    "fisher_prior",
    "keep_for_ratio",
    "mask_rewards",
    "pl_log_prob",
    "pl_sample",
    "search_mask",
    "vpruner_forward",
    "vpruner_gflops",
]

PRIORS = ("mask", "embedding")  # Fisher of the token's mask variable, or the trace over its channels


# --------------------------------------------------------------------------------------------
# the mask, the forward and its cost


def architecture(model: nn.Module) -> str:
    """The timm architecture name of ``model`` (``pretrained_cfg``; without its tag)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return str(cfg.get("architecture") or type(model).__name__)


def check_keep(model: nn.Module, keep: int) -> int:
    """``keep`` as an int in ``1..N`` (the model's patch positions), else a one-line ``ValueError``."""
    n = model.patch_embed.num_patches
    if isinstance(keep, bool) or int(keep) != keep or not 1 <= int(keep) <= n:
        raise ValueError(f"V-Pruner keeps K of the {n} patch positions of this model: K must be 1..{n}, got {keep}")
    return int(keep)


def check_positions(model: nn.Module, kept: Sequence[int]) -> torch.Tensor:
    """Kept patch positions as a sorted ``long`` tensor; distinct, each in ``0..N-1``, at least one."""
    n = model.patch_embed.num_patches
    idx = torch.as_tensor(list(kept), dtype=torch.long)
    if idx.numel() == 0 or idx.min() < 0 or idx.max() >= n or idx.unique().numel() != idx.numel():
        raise ValueError(f"a V-Pruner mask lists distinct patch positions in 0..{n - 1} (at least one); "
                         f"got {idx.numel()} position(s) in {[int(idx.min()), int(idx.max())] if idx.numel() else []}")
    return idx.sort().values


@dataclass(frozen=True)
class VPrunerCost:
    gflops: float  # per image (the mask's gather adds none)
    keep: int  # visual tokens kept
    r: List[int]  # visual tokens removed per block, as the other baselines report it: N - K at block 0
    tokens: List[int]  # visual tokens after each block


def vpruner_gflops(model: nn.Module, keep: int, skip_dead: bool = False) -> VPrunerCost:
    """GFLOPs per image of :func:`vpruner_forward` with ``keep`` visual tokens kept (the same for
    every image and mask): patch embedding on all patches, every block on ``P + K`` tokens."""
    k = check_keep(model, keep)
    cost = backbone_cost(model)
    p, depth = cost.num_prefix, len(model.blocks)
    n = torch.tensor([p + k])
    macs = float(cost.patch_macs + cost.head_macs)
    for l in range(depth):
        macs += float(cost.block_macs(l, n, torch.tensor([p]) if skip_dead and l == depth - 1 else n))
    macs += float(cost.pool_macs(n))
    return VPrunerCost(2 * macs / 1e9, k, [cost.num_patches - k] + [0] * (depth - 1), [k] * depth)


def keep_rows(model: nn.Module, kept: torch.Tensor) -> torch.Tensor:
    """Token rows kept by a mask: the prefix rows, then ``P + kept`` (``kept`` sorted)."""
    p = model.num_prefix_tokens
    return torch.cat([torch.arange(p, device=kept.device), p + kept])


def blocks_and_head(model: nn.Module, x: torch.Tensor, skip_dead: bool = False) -> torch.Tensor:
    """timm's blocks, final norm and head on tokens ``x`` (``skip_dead``: the last block's MLP on
    the prefix rows only, all a CLS-token readout reads)."""
    if not skip_dead:
        return head(model, model.blocks(x))
    for blk in model.blocks[:-1]:
        x = blk(x)
    last = model.blocks[-1]
    x = (x + last.drop_path1(last.ls1(last.attn(last.norm1(x)))))[:, : model.num_prefix_tokens]
    return head(model, mlp_residual(last, x))


def vpruner_forward(model: nn.Module, x: torch.Tensor, kept: Union[torch.Tensor, Sequence[int]],
                    skip_dead: bool = False) -> torch.Tensor:
    """Logits of ``model`` (a timm ViT, not wrapped) on images ``x`` with only the visual tokens at
    patch positions ``kept`` (0-based, row-major over the patch grid) entering block 0; prefix tokens
    always kept. All positions kept: the native forward."""
    idx = check_positions(model, kept if not isinstance(kept, torch.Tensor) else kept.tolist())
    t = embed(model, x)
    if idx.numel() < model.patch_embed.num_patches:
        t = t.index_select(1, keep_rows(model, idx.to(t.device)))
    return blocks_and_head(model, t, skip_dead)


@dataclass
class VPrunerMask:
    """A searched mask and what it was searched for: the JSON file format (``save`` / ``load``)."""

    model: str  # timm architecture (no tag)
    grid: List[int]  # patch grid [rows, cols]
    num_prefix: int
    keep: int
    kept: List[int]  # sorted patch positions, row-major
    gflops: float = 0.0
    native_gflops: float = 0.0
    weights: Optional[str] = None  # the backbone weights' file name the search ran on
    search: Dict[str, Any] = field(default_factory=dict)  # config, data, split, images
    result: Dict[str, Any] = field(default_factory=dict)  # rewards and agreement on the search images
    search_cost: Dict[str, Any] = field(default_factory=dict)  # wall seconds, forward passes, device

    def check(self, model: nn.Module) -> torch.Tensor:
        """The kept positions as a tensor, after checking that the mask was made for ``model``."""
        grid = list(model.patch_embed.grid_size)
        if self.model != architecture(model) or self.grid != grid or self.num_prefix != model.num_prefix_tokens:
            raise ValueError(f"this V-Pruner mask was searched for {self.model} (grid {self.grid}, {self.num_prefix} "
                             f"prefix tokens), not {architecture(model)} (grid {grid}, {model.num_prefix_tokens})")
        if len(self.kept) != self.keep:
            raise ValueError(f"V-Pruner mask file lists {len(self.kept)} positions but says keep={self.keep}")
        check_keep(model, self.keep)
        return check_positions(model, self.kept)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"method": "vpruner", **asdict(self)}, indent=1)
        text = re.sub(r"\[\s+([-0-9.e, \n]+?)\s+\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)
        Path(path).write_text(text + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "VPrunerMask":
        data = json.loads(Path(path).read_text())
        if data.pop("method", None) != "vpruner":
            raise ValueError(f"{path} is not a V-Pruner mask file (no \"method\": \"vpruner\")")
        return cls(**data)


class VPruner:
    """A V-Pruner mask as a callable: ``VPruner(model, mask)(images) -> logits``; ``mask``: a
    :class:`VPrunerMask`, its JSON file, or the kept positions. The model is not modified."""

    def __init__(self, model: nn.Module, mask: Union[VPrunerMask, str, Path, Sequence[int]], skip_dead: bool = False):
        check_supported(model)
        check_skip_dead(model, "model", skip_dead, False)
        if isinstance(mask, (str, Path)):
            self.source: Optional[str] = str(mask)
            mask = VPrunerMask.load(mask)
        else:
            self.source = None
        self.mask = mask if isinstance(mask, VPrunerMask) else None
        self.kept = mask.check(model) if isinstance(mask, VPrunerMask) else check_positions(model, mask)
        self.model, self.skip_dead = model, skip_dead
        self.cost = vpruner_gflops(model, self.kept.numel(), skip_dead)

    @property
    def name(self) -> str:
        return f"vpruner(K={self.kept.numel()})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return vpruner_forward(self.model, x, self.kept, self.skip_dead)


def keep_for_ratio(model: nn.Module, ratio: float) -> int:
    """``K = round(ratio * N)`` kept positions for a keep ratio in ``(0, 1]``."""
    if not 0 < ratio <= 1:
        raise ValueError(f"keep ratios lie in (0, 1], got {ratio}")
    return check_keep(model, max(1, round(ratio * model.patch_embed.num_patches)))


# --------------------------------------------------------------------------------------------
# the search: Fisher prior, Plackett-Luce policy, PPO


@dataclass(frozen=True)
class SearchConfig:
    """The search's hyperparameters, named once (defaults: the committed masks' search, sized for
    about a minute of two shared CPU cores per budget on a Tiny backbone, about 800 image forwards)."""

    prior: str = "mask"  # Fisher of the mask variable ("mask") or the embedding's trace ("embedding")
    fisher_images: int = 96  # search images the Fisher prior is averaged over
    eval_images: int = 96  # held-out search images that score the export candidates (never drawn by PPO)
    prior_scale: float = 3.0  # std of the initial logits theta0 (exploration around the prior mask)
    iterations: int = 10  # PPO iterations
    masks: int = 8  # masks drawn per iteration
    images: int = 8  # search images per iteration (shared by its masks)
    ppo_epochs: int = 4  # clipped-ratio updates per iteration
    clip: float = 0.2  # PPO ratio clip
    lr: float = 0.1  # Adam step on theta
    prior_weight: float = 0.01  # L2 pull of theta toward theta0
    chunk: int = 64  # sequences per forward pass (memory only)
    seed: int = 0

    def __post_init__(self):
        if self.prior not in PRIORS:
            raise ValueError(f"prior must be one of {PRIORS}, got {self.prior!r}")
        if min(self.fisher_images, self.eval_images, self.iterations, self.masks, self.images, self.chunk) < 1:
            raise ValueError("V-Pruner search sizes (images, iterations, masks, chunk) must be 1 or more")
        if self.masks < 2:
            raise ValueError("PPO's advantage compares the masks of an iteration: masks must be 2 or more")


@dataclass
class SearchPool:
    """Search images prepared once per backbone: token embeddings, native log-probabilities, the
    Fisher importance of every position and which images PPO draws (``train``) or scores (``held``)."""

    tokens: torch.Tensor  # [I, P + N, C] embedded tokens
    native_logp: torch.Tensor  # [I, classes]
    fisher: torch.Tensor  # [N]
    train: torch.Tensor  # image indices PPO draws from
    held: torch.Tensor  # image indices the export candidates are scored on
    forwards: int = 0  # image forward passes spent on it: native on every image, then the Fisher images
    # again (each of those also takes one backward pass)
    wall_s: float = 0.0


def _chunks(model: nn.Module, t: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([blocks_and_head(model, t[i:i + chunk]) for i in range(0, t.shape[0], chunk)])


def fisher_prior(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, prior: str = "mask",
                 chunk: int = 96) -> torch.Tensor:
    """Fisher importance ``[N]`` of every patch position over embedded ``tokens`` ``[I, P + N, C]``:
    ``E[(dL/dm_i)^2]`` with ``dL/dm_i = <dL/dx_i, x_i>`` (``prior="mask"``) or ``E[sum_c (dL/dx_ic)^2]``
    (``"embedding"``), ``L`` the cross-entropy of the logits to ``target`` classes ``[I]``."""
    if prior not in PRIORS:
        raise ValueError(f"prior must be one of {PRIORS}, got {prior!r}")
    p = model.num_prefix_tokens
    total = torch.zeros(tokens.shape[1] - p, dtype=torch.float64)
    for i in range(0, tokens.shape[0], chunk):
        t = tokens[i:i + chunk].detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = F.cross_entropy(blocks_and_head(model, t).float(), target[i:i + chunk], reduction="sum")
            (g,) = torch.autograd.grad(loss, t)
        g, x = g[:, p:].float(), t.detach()[:, p:].float()
        score = (g * x).sum(-1).square() if prior == "mask" else g.square().sum(-1)
        total += score.sum(0).double().cpu()
    return (total / tokens.shape[0]).float()


@torch.no_grad()
def build_pool(model: nn.Module, images: torch.Tensor, config: SearchConfig = SearchConfig(),
               batch: int = 64) -> SearchPool:
    """Embed ``images`` once, run the native model on them, split them (seeded) into PPO's images
    and ``config.eval_images`` held-out ones, and average the Fisher prior over the first
    ``config.fisher_images`` of PPO's."""
    t0 = time.perf_counter()
    n_img = images.shape[0]
    if n_img < config.eval_images + config.images:
        raise ValueError(f"the V-Pruner search needs at least eval_images + images = "
                         f"{config.eval_images + config.images} search images, got {n_img}")
    tokens = torch.cat([embed(model, images[i:i + batch]) for i in range(0, n_img, batch)])
    native_logp = F.log_softmax(_chunks(model, tokens, config.chunk).float(), -1)
    order = torch.randperm(n_img, generator=torch.Generator().manual_seed(config.seed))
    held, train = order[:config.eval_images].sort().values, order[config.eval_images:]
    fis = train[:config.fisher_images]
    fisher = fisher_prior(model, tokens[fis], native_logp[fis].argmax(-1), config.prior, config.chunk)
    return SearchPool(tokens, native_logp, fisher, train.sort().values, held, n_img + fis.numel(),
                      time.perf_counter() - t0)


def prior_logits(fisher: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * standardise(log F)``: the policy's initial logits (higher: kept first)."""
    z = fisher.double().clamp_min(1e-30).log()
    return (scale * (z - z.mean()) / z.std().clamp_min(1e-12)).float()


def pl_sample(theta: torch.Tensor, drops: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` Plackett-Luce draws of ``drops`` positions to delete, in the order drawn: each next
    one with probability ``softmax(-theta)`` over the positions left (Gumbel-top-k). ``[count, drops]``."""
    u = torch.rand(count, theta.numel(), generator=generator).clamp(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(u))
    return (-theta.detach()[None] + gumbel).topk(drops, dim=1).indices


def pl_log_prob(theta: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Log-probability ``[count]`` of each drawn deletion sequence ``order`` ``[count, drops]`` under
    the Plackett-Luce policy with logits ``-theta``."""
    count, drops = order.shape
    n = theta.numel()
    step = torch.full((count, n), drops, dtype=torch.long)  # the step at which a position is drawn
    step.scatter_(1, order, torch.arange(drops).expand(count, -1))
    left = step[:, None, :] >= torch.arange(drops)[None, :, None]  # [count, drops, N]: still there at step j
    u = (-theta)[None, None, :].expand(count, drops, n)
    norm = torch.logsumexp(u.masked_fill(~left, -math.inf), dim=-1)
    return ((-theta)[order] - norm).sum(-1)


def kept_from_drops(n: int, order: torch.Tensor) -> torch.Tensor:
    """Sorted kept positions ``[count, N - drops]`` from deletion sequences ``[count, drops]``."""
    keep = torch.ones(order.shape[0], n, dtype=torch.bool)
    keep.scatter_(1, order, False)
    return keep.nonzero()[:, 1].view(order.shape[0], -1)


@torch.no_grad()
def mask_rewards(model: nn.Module, pool: SearchPool, kept: torch.Tensor, imgs: torch.Tensor,
                 chunk: int = 96) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(-KL(native || masked), top-1 agreement with native)`` of each mask ``kept`` ``[M, K]``
    averaged over the search images ``imgs``: ``[M]`` each (every mask on the same images)."""
    t = pool.tokens[imgs]
    dev = t.device
    batch = torch.cat([t.index_select(1, keep_rows(model, k.to(dev))) for k in kept])
    logp = F.log_softmax(_chunks(model, batch, chunk).float(), -1).view(kept.shape[0], imgs.numel(), -1)
    nat = pool.native_logp[imgs][None]
    kl = (nat.exp() * (nat - logp)).sum(-1).mean(1)
    agree = (logp.argmax(-1) == nat.argmax(-1)).float().mean(1)
    return -kl.cpu(), agree.cpu()


@dataclass
class SearchResult:
    kept: List[int]  # the exported mask
    chose: str  # "policy" or "prior"
    scores: Dict[str, Dict[str, float]]  # per candidate: reward (-KL) and agreement on the held-out images
    curve: List[float]  # mean reward of the drawn masks per PPO iteration
    moved: int  # positions of the policy's mode not in the prior mask
    forwards: int  # image forward passes of this budget's search (PPO draws and the candidates' scoring)
    wall_s: float


def search_mask(model: nn.Module, images: Union[torch.Tensor, SearchPool], keep: int,
                config: SearchConfig = SearchConfig()) -> SearchResult:
    """V-Pruner's offline search of one mask with exactly ``keep`` visual tokens kept (module
    docstring): Fisher prior, PPO over Plackett-Luce masks, export of the better of the policy's
    mode and the prior mask on held-out search images. ``images``: preprocessed search images
    ``[I, 3, H, W]`` or a :class:`SearchPool` built once for several budgets. Deterministic for a
    ``config.seed`` (on one device and thread count)."""
    t0 = time.perf_counter()
    k = check_keep(model, keep)
    pool = images if isinstance(images, SearchPool) else build_pool(model, images, config)
    n = pool.fisher.numel()
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + k)
    theta0 = prior_logits(pool.fisher, config.prior_scale)
    prior_kept = pool.fisher.topk(k).indices.sort().values
    forwards, curve = 0, []
    theta = theta0.clone().requires_grad_(True)
    if k < n:
        opt = torch.optim.Adam([theta], lr=config.lr)
        for _ in range(config.iterations):
            order = pl_sample(theta, n - k, config.masks, gen)
            imgs = pool.train[torch.randperm(pool.train.numel(), generator=gen)[:config.images]]
            reward, _ = mask_rewards(model, pool, kept_from_drops(n, order), imgs, config.chunk)
            forwards += config.masks * imgs.numel()
            curve.append(float(reward.mean()))
            adv = (reward - reward.mean()) / reward.std().clamp_min(1e-8)
            with torch.no_grad():
                old = pl_log_prob(theta, order)
            for _ in range(config.ppo_epochs):
                ratio = (pl_log_prob(theta, order) - old).exp()
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - config.clip, 1 + config.clip) * adv).mean()
                loss = -surrogate + config.prior_weight * (theta - theta0).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    policy_kept = theta.detach().topk(k).indices.sort().values
    cands = {"prior": prior_kept} if torch.equal(policy_kept, prior_kept) else {"prior": prior_kept, "policy": policy_kept}
    reward, agree = mask_rewards(model, pool, torch.stack(list(cands.values())), pool.held, config.chunk)
    forwards += len(cands) * pool.held.numel()
    scores = {name: {"reward": float(r), "kl": -float(r), "agreement": float(a)}
              for name, r, a in zip(cands, reward, agree)}
    if "policy" not in scores:  # the policy's mode is the prior mask
        scores["policy"] = dict(scores["prior"])
    chose = "policy" if scores["policy"]["reward"] > scores["prior"]["reward"] else "prior"
    kept = (policy_kept if chose == "policy" else prior_kept).tolist()
    moved = k - int(torch.isin(policy_kept, prior_kept).sum())
    return SearchResult(kept, chose, scores, curve, moved, forwards, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# the command line: python -m timm_dora.evaluate.baselines.vpruner search ...


def _cpu_name() -> str:
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(l.split(":", 1)[1].strip() for l in lines if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "cpu"


def _search_command(args) -> int:
    from ...data import eval_transform, open_split, preload
    from ..setup import load_model

    if args.split == "test":
        raise ValueError("the V-Pruner search never runs on the test split: use the pool's rollout split")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_model(args.model, args.weights, random_weights=args.random_weights, img_size=args.img_size,
                       seed=args.seed).to(device)
    check_supported(model)
    sizes = {"iterations": args.iterations, "masks": args.masks, "images": args.images_per_iteration}
    config = SearchConfig(prior=args.prior, seed=args.seed, **{k: v for k, v in sizes.items() if v is not None})
    ds = open_split(args.data, args.split, eval_transform(model))
    images, _ = preload(ds, device=device, num_workers=args.workers)
    if args.images is not None and args.images < images.shape[0]:  # a seeded subset of the split
        pick = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(args.seed))[:args.images]
        images = images[pick.sort().values.to(device)]
    pool = build_pool(model, images, config)
    print(f"{args.model}: {images.shape[0]} {args.split} images; pool (native + Fisher) {pool.wall_s:.1f}s", flush=True)
    native = vpruner_gflops(model, model.patch_embed.num_patches).gflops
    where = f"{_cpu_name()} ({torch.get_num_threads()} threads)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    for ratio in args.keep_ratios:
        k = keep_for_ratio(model, ratio)
        res = search_mask(model, pool, k, config)
        gflops = vpruner_gflops(model, k).gflops
        mask = VPrunerMask(
            architecture(model), list(model.patch_embed.grid_size), model.num_prefix_tokens, k, res.kept, gflops, native,
            weights=Path(args.weights).name if args.weights else None,
            search={"config": asdict(config), "data": Path(args.data).name, "split": args.split,
                    "images": int(images.shape[0]), "held_out": int(pool.held.numel()), "keep_ratio": ratio},
            result={"chose": res.chose, "held_out": res.scores, "policy_moved": res.moved, "curve": res.curve,
                    "reward": "-KL(native || masked), mean over images; agreement: top-1 equal to native's"},
            search_cost={"wall_s": round(res.wall_s, 2), "forward_passes": res.forwards,
                         "shared_wall_s": round(pool.wall_s, 2), "shared_forward_passes": pool.forwards,
                         "shared_backward_passes": int(min(config.fisher_images, pool.train.numel())),
                         "shared": "the pool (embeddings, native outputs, Fisher prior): once per backbone for all budgets",
                         "device": where, "torch": torch.__version__})
        path = Path(args.out) / f"{architecture(model)}_keep{k}.json"
        mask.save(path)
        s = res.scores[res.chose]
        print(f"K={k:4d} {gflops:.3f} GFLOPs ({100 * (1 - gflops / native):.1f}% fewer)  chose {res.chose}: "
              f"KL {s['kl']:.4f} agreement {100 * s['agreement']:.1f}% (prior: KL {res.scores['prior']['kl']:.4f}, "
              f"{100 * res.scores['prior']['agreement']:.1f}%)  {res.wall_s:.1f}s  -> {path}", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    from ...command import one_line_errors

    ap = argparse.ArgumentParser(prog="python -m timm_dora.evaluate.baselines.vpruner",
                                 description="V-Pruner's offline mask search (one JSON mask per budget)")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", help="search one mask per keep ratio on the pool's rollout images")
    s.add_argument("--model", required=True, help="timm model name, e.g. vit_tiny_patch16_224")
    s.add_argument("--weights", default=None, help="local .safetensors state dict of the backbone")
    s.add_argument("--random-weights", action="store_true", help="random backbone weights (smoke tests only)")
    s.add_argument("--img-size", type=int, default=None, help="build the model for this input size (smoke tests)")
    s.add_argument("--data", required=True, help="labels CSV (or folder holding labels.csv)")
    s.add_argument("--split", default="rollout", help="the search images (never test)")
    s.add_argument("--images", type=int, default=None, help="a seeded random subset of N images of the split")
    s.add_argument("--keep-ratios", type=float, nargs="+", required=True, help="K = round(ratio * patches) per mask")
    s.add_argument("--prior", choices=PRIORS, default="mask")
    s.add_argument("--iterations", type=int, default=None, help="PPO iterations (default: SearchConfig's)")
    s.add_argument("--masks", type=int, default=None, help="masks drawn per PPO iteration (default: SearchConfig's)")
    s.add_argument("--images-per-iteration", type=int, default=None,
                   help="search images per PPO iteration (default: SearchConfig's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    s.add_argument("--workers", type=int, default=2, help="image loading processes")
    s.add_argument("--out", required=True, help="folder: one <architecture>_keep<K>.json per ratio")
    args = ap.parse_args(argv)
    return one_line_errors(ap.prog, lambda: _search_command(args))


if __name__ == "__main__":
    raise SystemExit(main())
