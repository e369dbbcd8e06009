"""Registry: named implementations of one interface (reasoning parsers, tool-call parsers), filled
by a decorator at import and looked up by the name a flag gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # for messages: "reasoning parser"
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: registers the class under `name` and sets its `name` attribute."""
        def deco(cls: T) -> T:
            cls.name = name
            self._items[name] = cls
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> T:
        """The class registered as `name`; ValueError listing the known names otherwise."""
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return self._items[name]
