"""``pytest --cuda-only``: on a GPU machine, run only the tests that a machine without CUDA skips
(those whose ``skipif`` reason names CUDA or a GPU), so that an engine change's CUDA tests run in
one short command (CI has no GPU and runs everything else)."""
import re

_GPU = re.compile(r"\bCUDA\b|\bGPU\b")


def pytest_addoption(parser):
    parser.addoption("--cuda-only", action="store_true",
                     help="run only the tests skipped without CUDA (their skipif reason names CUDA or a GPU)")


def needs_gpu(item) -> bool:
    """Whether one of ``item``'s ``skipif`` markers (its own, its class's or its module's) gives a
    reason that names CUDA or a GPU."""
    return any(_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--cuda-only"):
        return
    keep = [item for item in items if needs_gpu(item)]
    config.hook.pytest_deselected(items=[item for item in items if not needs_gpu(item)])
    items[:] = keep
