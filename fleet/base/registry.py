"""Named implementations of one kind: the one registry helper every pluggable policy uses.

Owns `Registry` (name -> class, with the error every caller gives for an unknown name) and
`Registered` (the mixin whose ``__init_subclass__`` puts a subclass declared with ``name=...``
into its kind's registry). Five kinds use it: routing policies (`router.pools.policies`), scaling
policies (`autoscaler.policy`), placement strategies (`fleet.placement.strategies`), engine kinds
(`fleet.engines.kinds`) and rollout judges (`fleet.rollout.judges`). A spec that names an
implementation is checked against the registry when it is parsed (STYLE: "strategies register by
name; the spec rejects unknown names, with the list of known ones").

It lives in `router/` because `router/` is the bottom layer every other package may import
(docs/architecture.md); it imports nothing of Fleet's.

Usage::

    ROUTING_POLICIES: Registry[RoutingPolicy] = Registry("routing policy")

    class RoutingPolicy(Registered, registry=ROUTING_POLICIES): ...   # the root of the kind
    class RoundRobin(RoutingPolicy, name="round-robin"): ...          # registered as round-robin
    class _Shared(RoutingPolicy): ...                                 # no name: not registered
"""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one kind by name. ``kind`` names the kind in errors (``"routing policy"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def add(self, name: str, cls: type[T]) -> None:
        """Register ``cls`` as ``name``. Raises ValueError if another class has the name."""
        other = self._classes.get(name)
        if other is not None and other is not cls:
            raise ValueError(f"{self.kind} {name!r} is already registered by {other!r}")
        self._classes[name] = cls

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``. Raises KeyError naming the kind and the known names
        (``unknown routing policy 'x'; known: kv-aware, latency-aware, ...``)."""
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(self._unknown(name)) from None

    def check(self, name: str) -> str:
        """``name`` if registered; else ValueError with `get`'s message (for pydantic field
        validators, which turn a ValueError into an error naming the field)."""
        if name not in self._classes:
            raise ValueError(self._unknown(name))
        return name

    def _unknown(self, name: str) -> str:
        return f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"


class Registered:
    """Mixin: a subclass declared with ``name=...`` joins the registry of its kind.

    The root class of a kind names the registry (``registry=...``); every subclass with a
    ``name`` is added to it and gets ``cls.name``; subclasses without one (shared intermediate
    classes) are not registered.
    """

    registry: ClassVar[Registry]
    name: ClassVar[str] = ""

    def __init_subclass__(cls, *, name: str | None = None, registry: Registry | None = None,
                          **kwargs: object) -> None:  # fmt: skip
        super().__init_subclass__(**kwargs)
        if registry is not None:
            cls.registry = registry
        if name is not None:
            cls.registry.add(name, cls)
            cls.name = name
