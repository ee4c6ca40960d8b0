"""The network setup a VM's start runs beside QEMU: its steps all end before it answers,
and a VM is killed only once it ended (no VM: a waiting program stands in for QEMU and
the setup's programs are replaced by coroutines that record)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cryobox.errors import NetworkError, QemuError
from cryobox.network import namespace
from cryobox.network.namespace import Link
from cryobox.network.policy import NetworkPolicy, parse_policy
from cryobox.qemu import process
from cryobox.vmm.base import MachineSpec


async def test_attach_answers_only_once_every_step_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[str] = []

    async def host_rules_fail() -> None:
        raise NetworkError("nft -f - failed: no table")

    async def slow_link(pid: int) -> Link:
        await asyncio.sleep(0.2)
        ended.append("link")
        return Link("cbx9", "10.213.0.37", "10.213.0.38")

    async def no_addresses() -> list[str]:
        return []

    async def drop_link(link: Link) -> None:
        ended.append(f"dropped {link.name}")

    monkeypatch.setattr(namespace, "ensure_host_rules", host_rules_fail)
    monkeypatch.setattr(namespace, "_new_link", slow_link)
    monkeypatch.setattr(namespace, "_host_addresses", no_addresses)
    monkeypatch.setattr(namespace, "_drop_link", drop_link)
    with pytest.raises(NetworkError, match="no table"):
        await namespace.attach(os.getpid(), NetworkPolicy())
    # the link step was not left running, and the link it made does not stay behind (a
    # running VM given its first policy keeps its namespace: the slot would stay taken)
    assert ended == ["link", "dropped cbx9"]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="a VM's namespace of its own needs root")
async def test_a_vm_is_killed_only_after_its_network_setup_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = tmp_path / "qemu"
    stand_in.write_text("#!/bin/sh\nexec sleep 60\n")
    stand_in.chmod(0o755)
    seen: list[bool] = []

    async def slow_attach(pid: int, policy: NetworkPolicy) -> Link:
        await asyncio.sleep(0.3)
        seen.append(_running(pid))  # its pid is still the VM's: not free for another
        raise NetworkError("no free sandbox link")

    monkeypatch.setattr(process, "attach", slow_attach)
    spec = MachineSpec(
        name="cryobox-sbx-000000000000",
        cpus=1,
        memory_mib=64,
        accelerator="tcg",
        kernel=tmp_path / "k",
        initrd=tmp_path / "i",
        disk_chain=(tmp_path / "d.qcow2",),
        memory_file=tmp_path / "mem",
        monitor_socket=tmp_path / "q.sock",  # never made: the start times out
        agent_socket=tmp_path / "a.sock",
        console_log=tmp_path / "c.log",
        isolated=True,
    )
    vm = process.QemuProcess(spec, tmp_path / "stderr", binary=str(stand_in))
    with pytest.raises(QemuError, match="monitor did not come up"):
        await vm.start(timeout=0.1)
    assert seen == [True]
    assert vm.returncode is not None and not _running(vm.pid)  # killed after, and reaped


def test_the_hosts_resolvers_are_reached_on_port_53_only_in_every_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A guest on "internet" used to reach every port of the resolvers' address."""
    monkeypatch.setattr(namespace, "_resolvers", lambda: ["192.0.2.53", "8.8.8.8"])
    link = Link("cbx1", "10.213.0.5", "10.213.0.6")
    for policy in (NetworkPolicy(), NetworkPolicy(mode="allow")):
        lines = [line.strip() for line in namespace._sandbox_rules(policy, link, []).splitlines()]
        dns = lines.index("ip daddr 192.0.2.53 udp dport 53 accept")
        assert lines[dns + 1] == "ip daddr 192.0.2.53 tcp dport 53 accept"
        assert "ip daddr { 192.0.2.53 } reject" in lines[dns + 2 :]
        assert "8.8.8.8 }" not in " ".join(lines)  # a public resolver: the internet's
        if policy.mode == "internet":
            assert lines.index("accept") > lines.index("ip daddr { 192.0.2.53 } reject")
        if shutil.which("nft") and os.geteuid() == 0:  # and nft takes it (checked only)
            rules = namespace._sandbox_rules(policy, link, [])
            checked = subprocess.run(["nft", "-c", "-f", "-"], input=rules, text=True)
            assert checked.returncode == 0


def test_allowed_entries_win_over_denied_ones_and_the_rest_follows_the_mode() -> None:
    """The filter's order is the policy's meaning: allowed, then denied, then the mode."""
    link = Link("cbx1", "10.213.0.5", "10.213.0.6")
    policy = parse_policy({"allow": ["198.51.100.7:443"], "deny": ["198.51.100.0/24"]})
    lines = [line.strip() for line in namespace._sandbox_rules(policy, link, []).splitlines()]
    allowed = lines.index("ip daddr 198.51.100.7/32 tcp dport 443 accept")
    denied = lines.index("ip daddr 198.51.100.0/24 reject")
    assert allowed < denied < lines.index("accept")
    # One transaction that replaces the table in force (a change while it runs).
    assert lines[1:3] == ["table inet sandbox", "delete table inet sandbox"]
    closed = namespace._sandbox_rules(NetworkPolicy(mode="none"), link, [])
    assert "dport 53" not in closed and closed.split()[-3:] == ["reject", "}", "}"]
    if shutil.which("nft") and os.geteuid() == 0:
        for rules in (namespace._sandbox_rules(policy, link, []), closed):
            checked = subprocess.run(["nft", "-c", "-f", "-"], input=rules, text=True)
            assert checked.returncode == 0


async def test_a_policy_change_without_a_link_makes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox made with "none" has no link; given a way out, it gets one (and a
    namespace that has one keeps it, only its filter replaced)."""
    made: list[NetworkPolicy] = []

    async def fake_attach(pid: int, policy: NetworkPolicy) -> Link:
        made.append(policy)
        return Link("cbx9", "10.213.0.37", "10.213.0.38")

    applied: list[str] = []

    async def fake_run(argv: list[str], stdin: str = "") -> str:
        applied.append(stdin)
        return "[]" if argv[-1] == "show" else ""

    monkeypatch.setattr(namespace, "attach", fake_attach)
    monkeypatch.setattr(namespace, "_run", fake_run)
    link = await namespace.change(1234, None, NetworkPolicy())
    assert link == Link("cbx9", "10.213.0.37", "10.213.0.38") and made == [NetworkPolicy()]
    again = await namespace.change(1234, link, NetworkPolicy(mode="none"))
    assert again is link and made == [NetworkPolicy()]
    assert any("delete table inet sandbox" in text for text in applied)


def test_every_cryobox_on_a_host_writes_the_same_host_table() -> None:
    """The host-wide ``inet cryobox`` table does not depend on the sandbox subnet a
    process was given: another state folder's service (another subnet) rewriting it
    leaves every sandbox its way out (its masquerade). nftables accepts it as written."""
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cryobox.network import namespace; print(namespace.HOST_RULES, end='')",
        ],
        env={**os.environ, "CRYOBOX_SANDBOX_SUBNET": "10.77.0.0/30"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert other == namespace.HOST_RULES
    assert "10.213." not in namespace.HOST_RULES
    if shutil.which("nft") and os.geteuid() == 0:
        for only in ("drop", ""):
            rules = namespace.HOST_RULES.replace("ONLY_SANDBOXES", only)
            checked = subprocess.run(["nft", "-c", "-f", "-"], input=rules, text=True)
            assert checked.returncode == 0
