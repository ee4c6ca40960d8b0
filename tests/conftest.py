"""Shared fixtures: an isolated state folder, and a sandbox factory that always cleans up.

The state folder is short on purpose (unix socket paths are limited to 108 bytes)
and per test session, so tests never see a user's sandboxes. The guest image cache is
the user's (building it takes a minute; its content key keeps it honest).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# hypothesis is imported here, early: imported first by its own pytest plugin at the end
# of a run where no test used it, CPython 3.11.7's parser fails with "AST constructor
# recursion depth mismatch" (a CPython bug, fixed in later 3.11 releases).
import hypothesis  # noqa: F401
import pytest

from api_server import ApiServer, kill_vms_of, make_server, print_stacks, remove_state

STATE = Path(tempfile.mkdtemp(prefix="cbx-"))
os.environ["CRYOBOX_STATE_DIR"] = str(STATE)
# Warm pools off: a refill after every create would compete with each test for the two
# cores. tests/integration/test_pool_vm.py turns them on for its own tests.
os.environ["CRYOBOX_POOL_SIZE"] = "0"
# Pauses end their VM at once: the tests of pause and resume are about the saved machine
# (what a resume reads, refuses, pulls from a store, finishes after a crash).
# tests/integration/test_pause_hold_vm.py tests the hold the product has by default.
os.environ["CRYOBOX_PAUSE_HOLD"] = "0"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill anything a test left behind, then remove the state folder: the VMs of every
    host folder under it, uploaders, refills, RAM still arriving and their FUSE files,
    and whatever supervisor or server still works in it (else it would make it again)."""
    from cryobox.service import discard_spare

    discard_spare()  # (the warm supervisor of the session's own folder)
    remove_state(STATE)


#: VM test files that may run beside the others, once the unit tests are done: each has
#: its own state, server and ports, no fixed host name or address, and waits in minutes.
BESIDE_THE_VMS = ("tests/integration/test_readme_vm.py", "tests/integration/test_dockerfile_vm.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How ``make test``'s two pytest-xdist workers share the tests: every other test that
    boots VMs (integration, compat) on one worker, in order, as without xdist; the unit
    tests, then ``BESIDE_THE_VMS``, on the other beside them, each file together so its
    fixtures are made once. Under TCG a VM keeps about 1.2 of the 2 cores busy: two at
    once starve each other (deadlines and timed loops were set for one), and some use
    fixed host names and addresses (the network and fleet tests)."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class VmsApart(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith("tests/unit/") or path in BESIDE_THE_VMS else "vm"

    return VmsApart(config, log)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def dump_consoles(request: pytest.FixtureRequest, folders: list[Path]) -> None:
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for folder in folders:
            for name in ("console.log", "supervisor.log", "qemu.stderr"):
                path = folder / name
                if path.exists():
                    tail = "\n".join(path.read_text(errors="replace").splitlines()[-40:])
                    print(f"\n===== {folder.name}/{name} (last lines) =====\n{tail}")


def _sandbox_folders() -> set[Path]:
    """Every sandbox folder under the session's state folder: the embedded service's and
    each test server's (a host of its own under it)."""
    found: set[Path] = set()
    for pattern in ("sandboxes/*", "*/sandboxes/*", "*/*/sandboxes/*"):
        found.update(STATE.glob(pattern))
    return found


@pytest.fixture(autouse=True)
def vm_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever made them (a factory, the SDK, a server, the e2b SDK, a fork), the VMs a
    test started have their logs printed when it fails (every sandbox folder that
    appeared under the state folder during the test), then are killed."""
    before = _sandbox_folders()
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        started = sorted(_sandbox_folders() - before)
        dump_consoles(request, started)
        print_stacks(STATE)
        # A test that failed, or ran out of time, inside a create has no handle to kill:
        # a VM still starting (stuck, spinning) would take the cores from the next tests.
        kill_vms_of(folder / "state.json" for folder in started)


@pytest.fixture
def sandbox_factory() -> Iterator[Callable[..., Any]]:
    """``sandbox_factory(**create_kwargs)`` -> a sync Sandbox, killed after the test."""
    from cryobox import Sandbox

    made: list[Sandbox] = []

    def make(**kwargs: Any) -> Sandbox:
        sbx = Sandbox.create(**kwargs)
        made.append(sbx)
        return sbx

    yield make  # (their logs on failure: vm_logs_on_failure)
    for sbx in made:
        try:
            sbx.kill()
        except Exception as exc:
            print(f"cleanup of {sbx.id} failed: {exc}")


@pytest.fixture(scope="module")
def shared_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One sandbox for a module's read-mostly checks (a cold boot costs ~15 s under TCG)."""
    from cryobox import Sandbox

    sbx = Sandbox.create("base", ports=[8000])  # the cold-boot path; others restore
    yield sbx
    sbx.kill()


# --------------------------------------------------------------------------- cryobox server


@pytest.fixture(scope="session")
def api_server() -> Iterator[ApiServer]:
    """A real server over the real VMM and this session's state folder, with a tenant."""
    server = make_server(STATE / "server")
    # Sandboxes' ports by host name too (PORT-ID.localhost:PORT, sent as a Host header).
    server.env["CRYOBOX_DOMAIN"] = f"localhost:{server.port}"
    server.key = server.tenant("tests")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A real PostgreSQL server on a loopback port, for the whole session."""
    from postgres_server import PostgresServer

    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3 server (SeaweedFS) on a loopback port, for the whole session."""
    from cryobox.bench.s3_server import S3Server

    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()
