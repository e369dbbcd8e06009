"""Registry: named implementations of one interface, looked up by the name a flag or a config gives.

Every registry in photon is one of these: model architectures, attention backends, grammar
backends, reasoning parsers and tool-call parsers. An entry is either registered by a class
decorator when its module is imported, or lazily by a `"module:Class"` path: the module is
imported on the first `get`, so optional dependencies (triton, xgrammar) and unused models cost
nothing until a configuration names them. An unknown name is a ValueError in one style
everywhere: `unknown <kind> 'x'; available: a, b`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str, lazy: dict[str, str] | None = None) -> None:
        self.kind = kind  # for messages: "reasoning parser"
        self._items: dict[str, T] = {}
        self._lazy: dict[str, str] = {}  # name -> "module:Class", imported by the first get()
        for name, target in (lazy or {}).items():
            self.register_lazy(name, target)

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: registers the class under `name` and sets its `name` attribute."""
        def deco(cls: T) -> T:
            cls.name = name
            self._items[name] = cls
            return cls
        return deco

    def register_lazy(self, name: str, target: str) -> None:
        """Registers `name` as the class at `target` ("package.module:Class"), imported on the
        first get(name)."""
        module, sep, attr = target.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"{self.kind} {name!r}: target must be 'module:Class', got {target!r}")
        self._items.pop(name, None)
        self._lazy[name] = target

    def names(self) -> list[str]:
        return sorted({*self._items, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def get(self, name: str) -> T:
        """The class registered as `name`; ValueError listing the known names otherwise."""
        if name in self._items:
            return self._items[name]
        if name not in self._lazy:
            raise self.unknown(name)
        module, _, attr = self._lazy[name].partition(":")
        cls: T = getattr(importlib.import_module(module), attr)
        self._items[name] = cls  # resolved once: later gets are a dict lookup
        return cls

    def unknown(self, name: str, also: Iterable[str] = ()) -> ValueError:
        """The error for a name not in the registry; `also`: names a caller accepts besides the
        registered ones (an "auto" it resolves itself)."""
        available = ", ".join([*also, *self.names()])
        return ValueError(f"unknown {self.kind} {name!r}; available: {available}")
