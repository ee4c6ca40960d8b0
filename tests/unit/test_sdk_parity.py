"""The sync SDK mirrors the async one: same methods, same parameters."""

from __future__ import annotations

import inspect

import pytest

from cryobox.client import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncSandbox,
    CommandHandle,
    Commands,
    Files,
    Sandbox,
)


def public(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("sync", "async_"),
    [
        (Sandbox, AsyncSandbox),
        (Commands, AsyncCommands),
        (Files, AsyncFiles),
        (CommandHandle, AsyncCommandHandle),
    ],
)
def test_same_methods_and_signatures(sync: type, async_: type) -> None:
    sync_members, async_members = public(sync), public(async_)
    assert sorted(sync_members) == sorted(async_members)
    for name, member in async_members.items():
        if callable(member) and not isinstance(member, type):
            async_sig = inspect.signature(member)  # type: ignore[arg-type]
            sync_sig = inspect.signature(sync_members[name])  # type: ignore[arg-type]
            assert list(sync_sig.parameters) == list(async_sig.parameters), name
            for param in async_sig.parameters.values():
                assert sync_sig.parameters[param.name].default == param.default, (name, param.name)
