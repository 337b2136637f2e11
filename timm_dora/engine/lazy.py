"""``lazy``: an attribute computed on first read and stored on the instance.

It is ``functools.cached_property`` without the lock that Python 3.11's version takes on every first
read: ``torch.compile`` (Dynamo) cannot trace that lock and breaks the graph at each such read of
the engine's per-forward objects (:class:`~timm_dora.engine.packing.Packed`'s layout,
:class:`~timm_dora.engine.protocol.ForwardConstants`). Those objects live within one forward of one
thread, so the lock guards nothing there. As with ``cached_property``, the value lives in the
instance's ``__dict__`` under the attribute's name (copy or delete it there).
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar

__all__ = ["lazy"]

T = TypeVar("T")


class lazy(Generic[T]):
    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Optional[Any], owner: Optional[type] = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]
        cache = obj.__dict__
        if self.name not in cache:
            cache[self.name] = self.fn(obj)
        return cache[self.name]
