"""CapturedStep: warm-up undone exactly (CPU), and replays equal eager steps (CUDA)."""
import pytest
import torch

from timm_dora.train.graph_step import CapturedStep


def _net_and_data(device="cpu", capturable=False):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, capturable=capturable)
    x = torch.randn(32, 8, device=device)
    y = torch.randn(32, 1, device=device)
    return net, opt, x, y


def _step(net, opt, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = (net(x) - y).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), 0.5)
        opt.step()
        return loss.detach()
    return step


@pytest.mark.parametrize("steps_before", [0, 2])
def test_restore_undoes_warmup_steps_exactly(steps_before):
    """After a snapshot, some steps and the restore, the next step equals the step an untouched
    twin takes (fresh Adam state when there was none, the saved state otherwise)."""
    net, opt, x, y = _net_and_data()
    twin, twin_opt, _, _ = _net_and_data()
    for _ in range(steps_before):
        _step(net, opt, x, y)()
        _step(twin, twin_opt, x, y)()
    cap = CapturedStep(_step(net, opt, x, y), list(net.parameters()), opt)
    saved = cap._snapshot()
    for _ in range(3):
        _step(net, opt, x, y)()
    cap._restore(saved)
    _step(net, opt, x, y)()
    _step(twin, twin_opt, x, y)()
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_steps_equal_eager_steps_on_cuda():
    net, opt, x, y = _net_and_data("cuda", capturable=True)
    twin, twin_opt, _, _ = _net_and_data("cuda", capturable=True)
    xs, ys = torch.randn(5, 32, 8, device="cuda"), torch.randn(5, 32, 1, device="cuda")
    static_x, static_y = x.clone(), y.clone()
    cap = CapturedStep(_step(net, opt, static_x, static_y), list(net.parameters()), opt)
    for i in range(5):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        got = cap().clone()
        want = _step(twin, twin_opt, xs[i], ys[i])()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), i
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
