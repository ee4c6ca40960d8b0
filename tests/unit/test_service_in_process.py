"""The service with its parts injected through constructors, down to the supervisor:
the fake VMM and a snapshot store of the test's own, supervisors served as tasks of
the test's event loop (:class:`~cryobox.sandbox.in_process.InProcessLauncher`). No
environment variable chooses anything, and no supervisor process starts."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from api_server import remove_state
from cryobox.errors import InvalidArgument, StateError
from cryobox.models import CommandRequest, CreateRequest, NetworkJson, SnapshotPurpose
from cryobox.sandbox import registry
from cryobox.sandbox.in_process import InProcessLauncher
from cryobox.service import SandboxService
from cryobox.service.pool import Member
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.vmm.fake import FakeVmm


class NoPools:
    """Warm pools that have no member and never refill."""

    def sizes(self) -> dict[str, int]:
        return {}

    def claims(self, template: str, snapshot_id: str, network: NetworkJson) -> Iterator[str]:
        return iter(())

    def members(self, template: str | None = None) -> list[Member]:
        return []

    def withdraw(self, member: Member) -> bool:
        return False

    def request_refill(self) -> None:
        raise AssertionError("no refill is asked for without a pool")

    def stop_refill(self) -> None:
        pass


@pytest.fixture
async def parts(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SandboxService]:
    state = Path(tempfile.mkdtemp(prefix="cbx-inproc-"))  # short: unix socket paths
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    monkeypatch.delenv("CRYOBOX_VMM", raising=False)  # nothing chosen by the environment
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "0")
    vmm, store = FakeVmm(), LocalSnapshotStore(state)
    launcher = InProcessLauncher(vmm, store)
    service = SandboxService(vmm, store, launcher, NoPools())
    try:
        yield service
    finally:
        for info in await service.list(all=True):
            if not registry.find(info.id).record().state.finished:
                await service.kill(info.id)
        await service.close()
        await launcher.close()
        remove_state(state)


async def _run(service: SandboxService, sandbox_id: str, shell: str) -> str:
    out = bytearray()
    session = await service.guest.start_command(
        sandbox_id, CommandRequest(shell=shell), lambda _stream, data: out.extend(data)
    )
    assert (await session.wait()).exit_code == 0
    return out.decode()


async def test_a_lifecycle_with_every_part_injected(parts: SandboxService, tmp_path: Path) -> None:
    service = parts
    note = str(tmp_path / "note")  # (the fake VMM's guest is the host: not its /tmp)
    info = await service.create(CreateRequest(template="base"))
    assert info.state == "running"
    assert info.supervisor_pid == os.getpid()  # served in this process, by a task
    assert await _run(service, info.id, "echo hi") == "hi\n"
    await service.guest.write_file(info.id, note, [b"kept"], 0o644)
    checkpoint = await service.capture(info.id, SnapshotPurpose.CHECKPOINT, "one")
    assert service.store.get(checkpoint.id).source_sandbox == info.id  # the injected store
    await service.rollback(info.id, "one")
    await service.pause(info.id)
    assert (await service.get(info.id)).state == "paused"
    with pytest.raises(StateError, match="paused"):
        await service.guest.start_command(info.id, CommandRequest(shell="true"), print)
    resumed = await service.resume(info.id)
    assert resumed.state == "running"
    assert await _run(service, info.id, f"cat {note}") == "kept"
    copies = await service.fork(info.id, 2)
    assert len({c.id for c in copies}) == 2
    for copy in copies:
        assert (await service.get(copy.id)).forked_from == info.id
        assert await _run(service, copy.id, f"cat {note}") == "kept"
    for each in (info, *copies):
        await service.kill(each.id)
        assert (await service.get(each.id)).state == "killed"


async def test_a_network_change_is_kept_in_the_spec_and_needs_a_running_sandbox(
    parts: SandboxService,
) -> None:
    """The layer under the real test (tests/integration/test_network_vm.py): the policy
    reaches the VM and the spec, which later starts and forks read."""
    service = parts
    info = await service.create(CreateRequest(template="base", network="none"))
    kept = await service.update_network(info.id, {"deny": ["192.0.2.0/24"]})
    assert kept == {"allow": [], "deny": ["192.0.2.0/24"]}
    assert (await service.get(info.id)).network == kept
    assert registry.find(info.id).spec().network == kept
    with pytest.raises(InvalidArgument, match="'nope'"):
        await service.update_network(info.id, {"nope": []})
    assert registry.find(info.id).spec().network == kept  # a refusal changes nothing
    await service.pause(info.id)
    with pytest.raises(StateError, match="paused"):
        await service.update_network(info.id, "internet")
    resumed = await service.resume(info.id)
    assert resumed.network == kept
    (copy,) = await service.fork(info.id, 1)
    assert copy.network == kept
