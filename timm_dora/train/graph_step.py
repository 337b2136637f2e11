"""Training steps of fixed shapes replayed from CUDA graphs, data parallel.

A PPO minibatch step (forward, loss, backward, gradient clipping, Adam) of the small critic launches
hundreds of small kernels: on the H100 the host took about 13 ms to issue what the GPU ran in about
1 ms. :class:`CapturedStep` captures such a step once and then replays it, in two parts around the
one sum of its gradients over processes (data parallel: each process adds the gradients of its own
rows of the minibatch).

The step must read everything that changes from one call to the next from *static buffers* (the
same tensors every call, refilled in place by the caller before each call), take no host decisions
from device values, and use an optimiser created with ``capturable=True``.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

__all__ = ["CapturedStep", "StaticBatch", "BackgroundSteps"]


class CapturedStep:
    """One minibatch step in two parts around a sum over processes, each part replayed from a CUDA
    graph on CUDA (captured on the first call).

    - ``grads()`` reads the static buffers (the rows loaded now) and returns a list of tensors: the
      step's gradients (``None`` for a parameter it does not reach) and the statistics it logs,
      each a *sum over the loaded rows* divided by the whole minibatch's divisors (its size, or
      a count over all of it), never by the loaded rows'. :meth:`add` adds
      them into one flat buffer, so a minibatch loaded in several chunks, or spread over several
      processes, adds up to the gradient of the whole minibatch.
    - :meth:`finish` sums the flat buffer over processes (``reduce``, once per step: one bucket),
      then ``apply(parts)`` takes the optimiser steps from the summed list (``None`` kept) and
      returns the statistics to log.

    A step is ``begin()``, ``add()`` once per chunk of rows, ``finish()``. Both parts must read
    only static buffers, take no host decisions from device values, and use optimisers created
    with ``capturable=True``. Capturing runs a few warm-up steps first (cuBLAS and autograd
    allocate on their first use) on copies of the parameters' and optimisers' state, which are put
    back afterwards: the first replayed step starts from exactly the state an eager step would.
    The two graphs share one memory pool, so what ``apply`` leaves in ``p.grad`` beyond the flat
    buffer's views (a new tensor) is scratch of the next ``add``: read gradients inside ``apply``.

    Args:
        grads, apply: the two parts (above).
        params: every parameter the step updates.
        optimizers: the optimiser, or optimisers, ``apply`` calls.
        reduce: sums a flat tensor over processes in place (``None``: one process).
        graphs: capture and replay (CUDA); else every part runs eagerly.
        warmup: eager steps (undone afterwards) before the capture.
    """

    def __init__(self, grads: Callable[[], List[Optional[torch.Tensor]]],
                 apply: Callable[[List[Optional[torch.Tensor]]], torch.Tensor], params: List[torch.nn.Parameter],
                 optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 reduce: Optional[Callable[[torch.Tensor], object]] = None, graphs: bool = True, warmup: int = 3) -> None:
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.grads, self.apply, self.params, self.optimizers = grads, apply, list(params), list(optimizers)
        self.reduce, self.graphs, self.warmup = reduce, graphs, warmup
        self.flat: Optional[torch.Tensor] = None
        self.layout: Optional[List[Optional[torch.Size]]] = None  # each part's shape (None: no gradient)
        self.added: Optional[torch.cuda.CUDAGraph] = None
        self.applied: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[torch.Tensor] = None

    def begin(self) -> None:
        if self.flat is not None:
            self.flat.zero_()

    def add(self) -> None:
        """Add the gradients and statistics of the rows loaded now."""
        if self.graphs and self.added is None:
            self._capture()
        if self.added is not None:
            self.added.replay()
        else:
            self._add()

    def finish(self) -> torch.Tensor:
        """Sum over processes, then the optimiser steps; returns the statistics (rewritten by the
        next step: copy them before)."""
        if self.reduce is not None:
            self.reduce(self.flat)
        if self.applied is not None:
            self.applied.replay()
            return self.out
        return self._apply()

    def _add(self) -> None:
        parts = self.grads()
        if self.layout is None:  # (an eager call: the first add, or the capture's warm-up)
            self.layout = [None if t is None else t.shape for t in parts]
            if any(t is not None and t.dtype != torch.float32 for t in parts):
                raise TypeError("CapturedStep: gradients and statistics must be float32")
            with torch.inference_mode(False):
                self.flat = torch.zeros(sum(s.numel() for s in self.layout if s is not None),
                                        device=next(t for t in parts if t is not None).device)
        self.flat.add_(torch.cat([t.reshape(-1) for t in parts if t is not None]))

    def _apply(self) -> torch.Tensor:
        parts, at = [], 0
        for shape in self.layout:
            if shape is None:
                parts.append(None)
                continue
            parts.append(self.flat[at : at + shape.numel()].view(shape))
            at += shape.numel()
        return self.apply(parts)

    def _capture(self) -> None:
        saved = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # (local: the warm-up sums over no other process)
                self.begin()
                self._add()
                self._apply()
        torch.cuda.current_stream().wait_stream(side)
        self._restore(saved)
        with torch.inference_mode(False):  # (on this stream, not the warm-up's)
            self.flat = torch.zeros_like(self.flat)
        self.added, self.applied = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.added):
            self._add()
        with torch.cuda.graph(self.applied, pool=self.added.pool()):
            self.out = self._apply()

    def _state(self, p: torch.nn.Parameter) -> Dict:
        """``p``'s optimiser state (empty before its first step)."""
        for opt in self.optimizers:
            if p in opt.state:
                return opt.state[p]
        return {}

    def _snapshot(self) -> Dict:
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self._state(p).items()}
                 for p in self.params}
        return {"params": [p.detach().clone() for p in self.params], "state": state}

    @torch.no_grad()
    def _restore(self, saved: Dict) -> None:
        """Parameters and optimiser state back to ``saved``, in place (the graphs keep addresses).
        State the warm-up created (the optimiser's first step) is zeroed: Adam with a zero step
        count and zero moments is a fresh Adam."""
        for p, v in zip(self.params, saved["params"]):
            p.copy_(v)
        for p in self.params:
            st = self._state(p)
            before = saved["state"][p]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(before[k]) if k in before else v.zero_()


class StaticBatch:
    """Static buffers of one kind of PPO minibatch: one update's per-transition tensors (refilled in
    place every update, in buffers of a fixed number of rows) and one minibatch's rows (refilled
    before every step), so that a step always reads the same tensors
    (:class:`CapturedStep`).

    A minibatch fills ``capacity`` rows: ``idx`` (local row ids, padded with 0, a real row) and
    ``w`` (which rows are real); ``n`` and ``n_on`` are the loss divisors (the minibatch's counts)."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.idx = torch.zeros(capacity, dtype=torch.long, device=device)
        self.w = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.n = torch.ones((), device=device)
        self.n_on = torch.ones((), device=device)
        self.shapes: Dict[str, tuple] = {}

    def load(self, rows: int, **tensors: torch.Tensor) -> bool:
        """Copy one update's tensors (each of at most ``rows`` rows) into buffers of ``rows`` rows;
        returns whether any buffer was (re)allocated (a new shape: captured steps must be captured
        again). Rows past a tensor's own keep the values of an earlier update (real rows, never read
        as real here)."""
        fresh = False
        for k, t in tensors.items():
            shape = (rows, *t.shape[1:], t.dtype)
            if self.shapes.get(k) != shape:
                setattr(self, k, t.new_zeros(rows, *t.shape[1:]))
                self.shapes[k] = shape
                fresh = True
            getattr(self, k)[: t.shape[0]].copy_(t)
        return fresh

    def select(self, idx: torch.Tensor, n: int, n_on: int = 1) -> None:
        m = idx.shape[0]
        self.idx[:m].copy_(idx)
        self.idx[m:].zero_()
        self.w.copy_(torch.arange(self.capacity, device=self.w.device) < m)
        self.n.fill_(float(n))
        self.n_on.fill_(float(max(n_on, 1)))


class BackgroundSteps:
    """Work left running on a second CUDA stream while the host goes on (one piece at a time).

    :meth:`launch` makes the second stream wait for what the current stream has queued, then runs
    ``work`` on it: from a thread of its own (one per launch) when ``work`` only replays captured
    graphs (launching one costs the host about 1 ms for a graph of hundreds of kernels, and
    ``CUDAGraph.replay`` releases the GIL), else here (a capture, with autograd and compiling, stays on the calling
    thread). :meth:`finish` makes the current stream wait for it and returns what ``work``
    returned. Whatever ``work`` reads must not change, and what it writes must not be read,
    until then."""

    def __init__(self) -> None:
        self.stream: Optional[torch.cuda.Stream] = None
        self.pending: Optional[tuple] = None  # (the launching thread or None, its result box)

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def launch(self, work: Callable[[], torch.Tensor], replays_only: bool, reads: Sequence[torch.Tensor] = ()) -> None:
        """Run ``work`` on the second stream; ``reads``: tensors of the current stream it reads
        (kept from reuse until it is done)."""
        if self.pending is not None:
            raise RuntimeError("BackgroundSteps.launch: the last work was not finished")
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        for t in reads:
            t.record_stream(self.stream)

        def run() -> torch.Tensor:
            with torch.cuda.stream(self.stream):
                return work()

        box: Dict[str, object] = {}
        if not replays_only:
            box["out"] = run()
            self.pending = (None, box)
            return

        def target() -> None:
            try:
                torch.cuda.set_device(self.stream.device)  # (a new thread starts on device 0)
                box["out"] = run()
            except BaseException as e:  # raised again by finish()
                box["error"] = e

        # a thread per launch, joined by finish(): no thread is left over between launches
        thread = threading.Thread(target=target, name="timm-dora-background", daemon=True)
        thread.start()
        self.pending = (thread, box)

    def finish(self) -> Optional[torch.Tensor]:
        """Wait for the launched work (``None`` when there is none); returns its result."""
        if self.pending is None:
            return None
        thread, box = self.pending
        self.pending = None
        if thread is not None:
            thread.join()
        if "error" in box:
            raise box["error"]
        torch.cuda.current_stream().wait_stream(self.stream)
        return box["out"]

