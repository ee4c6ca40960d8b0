"""The sync SDK is derived from the async one: same members, same full signatures (kinds,
annotations with the sync types' names, defaults), same docstrings; the async members
are coroutines."""

from __future__ import annotations

import inspect

import pytest

from cryobox.client import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncProcesses,
    AsyncPty,
    AsyncPtyHandle,
    AsyncSandbox,
    AsyncWatchHandle,
    CommandHandle,
    Commands,
    Files,
    Processes,
    Pty,
    PtyHandle,
    Sandbox,
    WatchHandle,
)
from cryobox.client._blocking import sync_name


def public(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def described(member: object, drop_self: bool) -> list[tuple[str, str, object, str]]:
    signature = inspect.signature(member)  # type: ignore[arg-type]
    params = list(signature.parameters.values())[1 if drop_self else 0 :]
    return [(p.name, p.kind.name, p.default, sync_name(str(p.annotation))) for p in params] + [
        ("return", "", None, sync_name(str(signature.return_annotation)))
    ]


PAIRS = [
    (Sandbox, AsyncSandbox),
    (Commands, AsyncCommands),
    (Files, AsyncFiles),
    (Processes, AsyncProcesses),
    (CommandHandle, AsyncCommandHandle),
    (Pty, AsyncPty),
    (PtyHandle, AsyncPtyHandle),
    (WatchHandle, AsyncWatchHandle),
]


@pytest.mark.parametrize(("sync", "async_"), PAIRS)
def test_same_members_signatures_and_docstrings(sync: type, async_: type) -> None:
    sync_members, async_members = public(sync), public(async_)
    assert sorted(sync_members) == sorted(async_members)
    for name, member in async_members.items():
        if isinstance(member, AsyncProcesses):  # ``Sandbox.processes``, on the class too
            assert isinstance(sync_members[name], Processes), name
            continue
        if isinstance(member, property):
            assert inspect.getdoc(sync_members[name]) == inspect.getdoc(member), name
            continue
        assert callable(member), name
        assert inspect.iscoroutinefunction(member), f"{async_.__name__}.{name} is not async"
        mine = sync_members[name]
        assert inspect.getdoc(mine) == inspect.getdoc(member), name
        if name == "run":  # overloads: compare the options declared once (RunOptions)
            assert "options" in inspect.signature(mine).parameters  # type: ignore[arg-type]
            continue
        instance = not isinstance(inspect.getattr_static(async_, name), staticmethod | classmethod)
        # An instance member read from the class: the async one still has ``self``; the
        # sync descriptor gives the same parameters with the target first.
        assert described(mine, drop_self=instance) == described(member, drop_self=instance), name


def test_every_async_member_has_a_docstring() -> None:
    for _, async_ in PAIRS:
        for name, member in public(async_).items():
            assert inspect.getdoc(member), f"{async_.__name__}.{name} has no docstring"


def test_an_id_prefix_names_one_sandbox_or_says_what_is_wrong() -> None:
    import asyncio
    from types import SimpleNamespace
    from typing import Any

    from cryobox.client.async_sandbox import whole_id
    from cryobox.errors import InvalidArgument, SandboxNotFound

    ids = ["sbx-4f2a00000001", "sbx-4f2a00000002", "sbx-9c0000000003"]

    class Listing:
        async def list(self, *, all: bool = False) -> list[Any]:
            return [SimpleNamespace(id=i) for i in ids]

    def resolve(given: str) -> str:
        return asyncio.run(whole_id(Listing(), given))  # type: ignore[arg-type]

    assert resolve("9c00") == resolve("sbx-9c00") == "sbx-9c0000000003"
    assert resolve("sbx-4f2a00000002") == "sbx-4f2a00000002"  # whole: not looked up
    assert resolve("my-name") == "my-name"  # not an id: the service says what it is
    with pytest.raises(InvalidArgument, match="sbx-4f2a00000001, sbx-4f2a00000002"):
        resolve("4f2a")
    with pytest.raises(SandboxNotFound, match="'beef'"):
        resolve("beef")
    # The whole id without sbx- names it too; a prefix under 4 digits says why not.
    assert resolve("4f2a00000002") == "sbx-4f2a00000002"
    for short in ("9c0", "sbx-9c"):
        with pytest.raises(InvalidArgument, match="at least 4 hex digits"):
            resolve(short)


def test_every_error_class_is_importable_from_cryobox() -> None:
    import cryobox
    from cryobox import errors

    for name in cryobox.ERRORS:
        assert getattr(cryobox, name) is getattr(errors, name)
    defined = {
        n
        for n, v in vars(errors).items()
        if isinstance(v, type) and v.__module__ == errors.__name__
    }
    assert {n for n in defined if issubclass(getattr(errors, n), Exception)} <= set(cryobox.ERRORS)
