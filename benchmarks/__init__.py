"""The benchmark scripts: run each from the repository root as ``python -m benchmarks.<name>``
(``benchmarks/README.md``); their shared helpers are in :mod:`benchmarks.common`."""
