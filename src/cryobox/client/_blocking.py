"""Derive the blocking SDK from the async one: each sync member runs its async twin.

A member is declared once, in the async SDK; here it becomes a descriptor that runs the
coroutine on the SDK's background loop (:mod:`._portal`), converts what it returns to
the sync types (an ``AsyncSandbox`` becomes a ``Sandbox``), and carries the twin's
docstring and signature (with the sync types' names), so ``help()`` and the parity
test see the same thing on both sides.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from . import _portal

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


def sync_name(annotation: str) -> str:
    """``"AsyncSandbox"`` -> ``"Sandbox"``, in an annotation written as a string."""
    for name in (
        "AsyncSandbox",
        "AsyncCommandHandle",
        "AsyncCommands",
        "AsyncFiles",
        "AsyncPtyHandle",
        "AsyncPty",
        "AsyncWatchHandle",
        "AsyncVolume",
    ):
        annotation = annotation.replace(name, name.removeprefix("Async"))
    return annotation


def _signature(fn: Callable[..., Any], drop_first: bool) -> inspect.Signature:
    signature = inspect.signature(fn)
    parameters = list(signature.parameters.values())[1 if drop_first else 0 :]
    annotation = signature.return_annotation
    if isinstance(annotation, str):
        annotation = sync_name(annotation)
    return signature.replace(parameters=parameters, return_annotation=annotation)


class _Twin:
    """A sync member standing for the async ``fn``; ``wrap`` converts what it returns."""

    def __init__(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], wrap: Callable[[Any], Any]
    ) -> None:
        self._fn = fn
        self._wrap = wrap
        self.__doc__ = fn.__doc__


class _Method(_Twin, Generic[P, T]):
    """An instance member: ``obj.name(...)`` runs ``fn(obj._async, ...)``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Callable[Concatenate[Any, P], T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, T]: ...
    def __get__(self, obj: object | None, owner: type) -> Callable[..., Any]:
        fn, wrap = self._fn, self._wrap

        if obj is None:

            def unbound(target: Any, *args: Any, **kwargs: Any) -> Any:
                return wrap(_portal.run(fn(target._async, *args, **kwargs)))

            unbound.__signature__ = _signature(fn, drop_first=False)  # type: ignore[attr-defined]
            return functools.update_wrapper(unbound, fn, assigned=("__doc__", "__name__"))

        def bound(*args: Any, **kwargs: Any) -> Any:
            target: Any = obj
            return wrap(_portal.run(fn(target._async, *args, **kwargs)))

        bound.__signature__ = _signature(fn, drop_first=True)  # type: ignore[attr-defined]
        return functools.update_wrapper(bound, fn, assigned=("__doc__", "__name__"))


class _Static(_Twin, Generic[P, T]):
    """A class-level member (a static or class method of the async twin)."""

    def __get__(self, obj: object | None, owner: type) -> Callable[P, T]:
        fn, wrap = self._fn, self._wrap

        def call(*args: Any, **kwargs: Any) -> Any:
            return wrap(_portal.run(fn(*args, **kwargs)))

        call.__signature__ = _signature(fn, drop_first=False)  # type: ignore[attr-defined]
        return functools.update_wrapper(call, fn, assigned=("__doc__", "__name__"))


def _same(value: T) -> T:
    return value


@overload
def method(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]) -> _Method[P, T]: ...
@overload
def method(
    fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]], wrap: Callable[[T], R]
) -> _Method[P, R]: ...
def method(fn: Callable[..., Coroutine[Any, Any, Any]], wrap: Callable[[Any], Any] = _same) -> Any:
    """The blocking twin of an async instance method."""
    return _Method(fn, wrap)


@overload
def static(fn: Callable[P, Coroutine[Any, Any, T]]) -> _Static[P, T]: ...
@overload
def static(fn: Callable[P, Coroutine[Any, Any, T]], wrap: Callable[[T], R]) -> _Static[P, R]: ...
def static(fn: Callable[..., Coroutine[Any, Any, Any]], wrap: Callable[[Any], Any] = _same) -> Any:
    """The blocking twin of an async static or class method."""
    return _Static(fn, wrap)
