"""Name -> function registries for the algorithm families, keyed by typed enums so configs pick by name."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from enum import StrEnum
from typing import Generic, TypeVar

from rlhf.errors import ConfigError

KindT = TypeVar("KindT", bound=StrEnum)
FnT = TypeVar("FnT", bound=Callable)


def parse_kind(enum_cls: type[KindT], value: str | KindT, what: str,
               aliases: dict[str, KindT] | None = None) -> KindT:
    """Turn a config string into its enum member; unknown names raise ConfigError listing the choices."""
    if isinstance(value, enum_cls):
        return value
    aliases = aliases or {}
    if isinstance(value, str):
        if value in aliases:
            return aliases[value]
        try:
            return enum_cls(value)
        except ValueError:
            pass
    names = [member.value for member in enum_cls] + list(aliases)
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown {what} {value!r}{hint}; choose one of: {', '.join(names)}")


class Registry(Generic[KindT, FnT]):
    """Maps each member of one enum to the function that implements it."""

    def __init__(self, enum_cls: type[KindT], what: str) -> None:
        self.enum_cls = enum_cls
        self.what = what
        self._fns: dict[KindT, FnT] = {}

    def register(self, kind: KindT) -> Callable[[FnT], FnT]:
        """Decorator registering `fn` as the implementation of `kind` (once per kind)."""

        def decorator(fn: FnT) -> FnT:
            assert kind not in self._fns, f"{self.what} {kind} registered twice"
            self._fns[kind] = fn
            return fn

        return decorator

    def get(self, kind: str | KindT) -> FnT:
        """The function for `kind`; unknown or unimplemented names raise ConfigError."""
        member = parse_kind(self.enum_cls, kind, self.what)
        if member not in self._fns:
            raise ConfigError(f"{self.what} {member.value!r} has no implementation registered; "
                              f"available: {', '.join(k.value for k in self.kinds())}")
        return self._fns[member]

    def kinds(self) -> list[KindT]:
        """The implemented kinds, in the enum's order."""
        return [kind for kind in self.enum_cls if kind in self._fns]
