"""Named things of one kind, each registered from its own file: datasets, models, and the other kinds that
plug in (a new one is one file with its ``@REGISTRY.register("name")`` line, and its test).

A :class:`Registry` is a read-only mapping from names to things (loaders, builders, classes). Given the
package that holds the kind's files, it imports every module of that package the first time it is read, so
that each file's registration has run: no list of names is kept anywhere else. Reading an unknown name with
:meth:`Registry.lookup` raises ``ValueError`` naming the field and the known names.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class Registry(Mapping[str, T], Generic[T]):
    """Names to things of one kind. ``field``: the configuration field that names one (``dataset``, ``model``),
    for the messages; ``package``: the dotted package whose modules register the things, imported on first
    read (None: the things are registered by whoever imports the registry)."""

    def __init__(self, field: str, package: str | None = None) -> None:
        self.field = field
        self.package = package
        self._things: dict[str, T] = {}
        self._loaded = package is None
        self._lock = threading.RLock()

    def register(self, name: str) -> Callable[[V], V]:
        """Decorator: registers the decorated thing under ``name`` and returns it unchanged."""

        def add(thing: V) -> V:
            self.add(name, thing)  # type: ignore[arg-type]  # V is the registry's T where it is used
            return thing

        return add

    def add(self, name: str, thing: T) -> None:
        """Registers ``thing`` under ``name``; a name registered twice is refused (two files claiming it)."""
        with self._lock:
            if name in self._things and self._things[name] is not thing:
                raise ValueError(f"{self.field} {name!r} is registered twice")
            self._things[name] = thing

    def remove(self, name: str) -> None:
        """Unregisters ``name`` (a test's registration of its own, undone); an unknown name is ignored."""
        with self._lock:
            self._things.pop(name, None)

    def lookup(self, name: str) -> T:
        """The thing registered as ``name``; ``ValueError`` naming the field and the known names otherwise."""
        self._load()
        try:
            return self._things[name]
        except KeyError:
            raise ValueError(f"{self.field}={name!r} is not one of {sorted(self._things)}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._load()
        return sorted(self._things)

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self.package is None:
                return
            package = importlib.import_module(self.package)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
                importlib.import_module(f"{self.package}.{info.name}")
            self._loaded = True

    # Mapping
    def __getitem__(self, name: str) -> T:
        self._load()
        return self._things[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._things))

    def __len__(self) -> int:
        self._load()
        return len(self._things)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}, {self.names()})"
