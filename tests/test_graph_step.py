"""CapturedStep: warm-up undone exactly, chunks and processes add up to the whole minibatch's step
(CPU), and replays equal eager steps (CUDA)."""
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
    """The reference: one eager step on all rows of x, y."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss = (net(x) - y).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), 0.5)
        opt.step()
        return loss.detach()
    return step


def _parts(net, opt, x, y, rows, total, w=None, forward=None, max_norm=0.5):
    """The two parts of the same step on the rows ``rows`` (static, refilled in place) of x, y:
    the gradient of the sum over those rows (weighted by ``w``) divided by the minibatch's
    ``total`` rows, through ``forward`` (default ``net``); ``None`` for a parameter it misses."""
    params, forward = list(net.parameters()), forward or net

    def grads():
        err = (forward(x[rows]) - y[rows]).square()
        loss = (err if w is None else w[:, None] * err).sum() / total
        return [*torch.autograd.grad(loss, params, allow_unused=True), loss.detach()[None]]

    def apply(parts):
        for p, g in zip(params, parts):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return parts[-1]
    return grads, apply


@pytest.mark.parametrize("steps_before", [0, 2])
def test_restore_undoes_warmup_steps_exactly(steps_before):
    """After a snapshot, some steps and the restore, the next step equals the step an untouched
    twin takes (fresh Adam state when there was none, the saved state otherwise)."""
    net, opt, x, y = _net_and_data()
    twin, twin_opt, _, _ = _net_and_data()
    for _ in range(steps_before):
        _step(net, opt, x, y)()
        _step(twin, twin_opt, x, y)()
    cap = CapturedStep(*_parts(net, opt, x, y, torch.arange(32), 32), list(net.parameters()), opt, graphs=False)
    saved = cap._snapshot()
    for _ in range(3):
        _step(net, opt, x, y)()
    cap._restore(saved)
    _step(net, opt, x, y)()
    _step(twin, twin_opt, x, y)()
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_chunks_and_processes_add_up_to_the_whole_minibatch(device):
    """Rows 0-31 in chunks on "this process", whose sum adds "another process's" gradient of
    rows 32-47 (its own chunks, summed in ``reduce``), equal one step on rows 0-47; the reduce runs
    once per step, and a parameter the loss does not reach gets no gradient and no Adam state. On
    CUDA every part is replayed from its graphs (the reduce between them)."""
    graphs = device == "cuda"
    torch.manual_seed(1)
    x, y = torch.randn(48, 8, device=device), torch.randn(48, 1, device=device)
    nets = []
    for _ in range(3):
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"f": torch.nn.Linear(8, 1), "unused": torch.nn.Linear(2, 2)}).to(device)
        nets.append((net, torch.optim.Adam(net.parameters(), lr=1e-2, capturable=graphs)))
    (ref, ref_opt), (mine, mine_opt), (other, other_opt) = nets
    unused, start = mine["unused"].weight.detach().clone(), mine["f"].weight.detach().clone()

    def parts(net, opt, rows, w):
        return _parts(net, opt, x, y, rows, 48, w, forward=net["f"], max_norm=0.05)

    # the static buffer of row ids: 12 a chunk (a short chunk repeats its last row, weighted 0)
    rows = torch.zeros(12, dtype=torch.long, device=device)
    w = torch.zeros(12, device=device)

    def load(first, last):
        idx = torch.arange(first, last, device=device)
        rows.copy_(torch.cat([idx, idx[-1:].expand(12 - len(idx))]))
        w.copy_(torch.arange(12, device=device) < len(idx))

    theirs = CapturedStep(*parts(other, other_opt, rows, w), list(other.parameters()), other_opt, graphs=graphs)
    calls = []

    def reduce(flat):  # "the other process" adds its rows 32-47 in two chunks
        calls.append(1)
        theirs.begin()
        for chunk in ((32, 44), (44, 48)):
            load(*chunk)
            theirs.add()
        flat.add_(theirs.flat)
        theirs.flat.copy_(flat)  # (every process holds the sum)

    step = CapturedStep(*parts(mine, mine_opt, rows, w), list(mine.parameters()), mine_opt, reduce=reduce, graphs=graphs)
    whole = CapturedStep(*parts(ref, ref_opt, torch.arange(48, device=device), torch.ones(48, device=device)),
                         list(ref.parameters()), ref_opt, graphs=graphs)
    for _ in range(3):
        step.begin()
        for chunk in ((0, 12), (12, 24), (24, 32)):
            load(*chunk)
            step.add()
        got = step.finish().clone()
        theirs.finish()
        whole.begin()
        whole.add()
        want = whole.finish()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got, want)
    assert len(calls) == 3
    for a, b, c in zip(mine.parameters(), ref.parameters(), other.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.equal(a, c)
    assert not torch.allclose(mine["f"].weight, start)  # (three steps moved it)
    assert mine["unused"].weight.grad is None and mine["unused"].weight not in mine_opt.state
    assert torch.equal(mine["unused"].weight, unused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_steps_equal_eager_steps_on_cuda():
    net, opt, x, y = _net_and_data("cuda", capturable=True)
    twin, twin_opt, _, _ = _net_and_data("cuda", capturable=True)
    xs, ys = torch.randn(5, 32, 8, device="cuda"), torch.randn(5, 32, 1, device="cuda")
    static_x, static_y = x.clone(), y.clone()
    rows = torch.zeros(16, dtype=torch.long, device="cuda")
    cap = CapturedStep(*_parts(net, opt, static_x, static_y, rows, 32), list(net.parameters()), opt)
    for i in range(5):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        cap.begin()
        for half in (torch.arange(16), torch.arange(16, 32)):  # two chunks of one minibatch
            rows.copy_(half)
            cap.add()
        got = cap.finish().clone()
        want = _step(twin, twin_opt, xs[i], ys[i])()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), i
    assert cap.added is not None and cap.applied is not None
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
