"""A network namespace per VM process: how a sandbox's policy is enforced.

Why a namespace: QEMU's user-mode network (slirp) opens ordinary sockets for the guest
and maps the guest's gateway address to the loopback of whatever namespace it runs in.
Run in the host's namespace, a guest reaches every service on the host's 127.0.0.1
and every other sandbox's forwarded port. Run in a namespace of its own, that
loopback is empty, and the only way out is the one this module builds:

- ``"none"``: no way out at all (the namespace has only its loopback);
- ``"internet"`` and lists of rules: a veth pair, the sandbox's end in the namespace
  with a default route, the host's end routed and masqueraded by the host. One nftables
  table on the host, ``inet cryobox``, drops everything from sandbox links to the host
  itself (all its addresses), to other sandbox links and to link-local addresses
  (cloud metadata services); replies to the host's own connections pass. A list of
  rules becomes an nftables output filter inside the sandbox's namespace, where
  slirp's sockets are opened.

The namespace is made by QEMU's own process before it executes (``unshare``), so it
ends with QEMU: a supervisor killed with -9 leaves no namespace and no link behind
(the veth pair is deleted with the namespace). Each link's name is its lock: creating
``cbxN`` fails if another sandbox holds N.

This is the mechanism E2B's and Firecracker's orchestrators use (a namespace per
microVM with a veth pair and host NAT), rather than Debian's ``passt`` with
``--no-map-gw``, which still lets the guest reach the host's other addresses and has
no filter for allow-lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import os
import random
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from cryobox.errors import NetworkError
from cryobox.network.addresses import LINK_LOCAL, PREFIX, SUBNET, addresses_of
from cryobox.network.policy import INTERNET, NONE, NetworkPolicy

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
LINK_PREFIX = "cbx"
#: Where the header proxy (:mod:`.header_proxy`) listens inside a sandbox's namespace:
#: not 127.0.0.1, where QEMU listens for the ports forwarded into the guest (any port a
#: user may forward); the mark its own connections out carry; the ports it serves.
HEADER_PROXY = ("127.0.0.2", 15080)
HEADER_MARK = 0xCB0
HEADER_PORTS = (80, 443)

_libc = ctypes.CDLL(None, use_errno=True)


def isolation_enabled() -> bool:
    """False only when the operator turned isolation off (``CRYOBOX_NETWORK_ISOLATION=off``)."""
    return os.environ.get("CRYOBOX_NETWORK_ISOLATION", "on") != "off"


def check_can_isolate() -> None:
    """:raises NetworkError: when this process may not make namespaces and links."""
    if isolation_enabled() and os.geteuid() != 0:
        raise NetworkError(
            "network isolation needs root (namespaces, veth links, nftables); run cryobox "
            "as root, or set CRYOBOX_NETWORK_ISOLATION=off to accept an unrestricted "
            "user-mode network that reaches the host's loopback"
        )


def isolate_this_process() -> None:
    """In the VM's child process before exec: a namespace of its own, loopback up.

    Ports below 1024 become bindable by the unprivileged user QEMU turns into, so that
    forwards to guest ports like 80 work inside the namespace (and nowhere else).
    """
    if _libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").write_text("0")


def namespace_path(pid: int) -> str:
    return f"/proc/{pid}/ns/net"


@dataclass(frozen=True)
class Link:
    """A sandbox's way out: the host end's name and both ends' addresses."""

    name: str
    host_address: str
    sandbox_address: str


#: Written when cryobox turned IPv4 forwarding on (it was off): the host then forwards
#: nothing but sandbox traffic. /run is emptied at boot, as the setting is.
FORWARDING_MARK = Path("/run/cryobox-enabled-forwarding")

#: The host's table names links, never this process's subnet
#: (``CRYOBOX_SANDBOX_SUBNET``): every cryobox on the host (another state folder,
#: another subnet) writes the same table, so none takes another's way out away.
HOST_RULES = f"""
table inet cryobox
delete table inet cryobox
table inet cryobox {{
    chain input {{
        type filter hook input priority filter - 10; policy accept;
        iifname "{LINK_PREFIX}*" ct state established,related accept
        iifname "{LINK_PREFIX}*" reject
    }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        iifname "{LINK_PREFIX}*" oifname "{LINK_PREFIX}*" reject
        iifname "{LINK_PREFIX}*" ip daddr {LINK_LOCAL} reject
        iifname "{LINK_PREFIX}*" accept
        oifname "{LINK_PREFIX}*" ct state established,related accept
        oifname "{LINK_PREFIX}*" drop
        ONLY_SANDBOXES
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        iifname "{LINK_PREFIX}*" oifname != "{LINK_PREFIX}*" masquerade
    }}
}}
"""

_host_ready: asyncio.Lock | None = None
_host_done = False


async def _run(argv: list[str], stdin: str = "") -> str:
    """Run a network tool; its output.

    :raises NetworkError: naming the command and what it said.
    """
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        raise NetworkError(
            f"{argv[0]} not found: install Debian's iproute2, nftables and util-linux "
            "(`make setup` does)"
        ) from exc
    out, err = await process.communicate(stdin.encode())
    if process.returncode != 0:
        raise NetworkError(f"{' '.join(argv)} failed: {err.decode(errors='replace').strip()}")
    return out.decode(errors="replace")


async def ensure_host_rules() -> None:
    """Forwarding on and the host's ``cryobox`` nftables table in place (once per process;
    replacing the table is one atomic transaction, so concurrent supervisors agree)."""
    global _host_ready, _host_done
    if _host_done:
        return
    _host_ready = _host_ready or asyncio.Lock()
    async with _host_ready:
        if _host_done:
            return
        forwarding = Path("/proc/sys/net/ipv4/ip_forward")
        if forwarding.read_text().strip() != "1":
            FORWARDING_MARK.touch()
            forwarding.write_text("1")
        # Forwarding was off before cryobox: keep it off for everything but sandboxes.
        only = "drop" if FORWARDING_MARK.exists() else ""
        await _run(["nft", "-f", "-"], HOST_RULES.replace("ONLY_SANDBOXES", only))
        _host_done = True


def _sandbox_rules(policy: NetworkPolicy, link: Link, host_addresses: list[str]) -> str:
    """The output filter inside the namespace, where slirp opens the guest's sockets, as
    one nftables transaction that replaces the one before (a policy changed while the
    sandbox runs is in force all at once, never half).

    Always: nothing to the host (its gateway here, every address the host has), to any
    sandbox link or to link-local addresses, and no IPv6. This repeats the host table's
    rules where a host firewall reload (``flush ruleset``) or a host DNAT cannot reach.
    Then the policy's allowed rules, its denied ones, and what is not listed: out for
    ``"internet"``, refused otherwise. DNS to the host's resolvers (which slirp's
    10.0.2.3 relays to) gets out but for ``"none"`` (a policy set to none while the
    sandbox runs keeps its link, and lets nothing through it).
    """
    never = sorted({link.host_address, str(SUBNET), LINK_LOCAL, *host_addresses})
    lines = [
        "oifname lo accept",
        "ct state established,related accept",
        "meta nfproto ipv6 reject",
        f"ip daddr {{ {', '.join(never)} }} reject",
    ]
    resolvers = _resolvers() if policy.mode != NONE else []
    for resolver in resolvers:
        lines += [
            f"ip daddr {resolver} udp dport 53 accept",
            f"ip daddr {resolver} tcp dport 53 accept",
        ]
    # DNS only, in every mode, of a resolver on the host's own network (its gateway, a
    # private or link-local address): no other port of it. A public resolver (8.8.8.8)
    # is the internet's, reached as the policy says.
    private = [r for r in resolvers if not ipaddress.ip_address(r).is_global]
    if private:
        lines.append(f"ip daddr {{ {', '.join(private)} }} reject")
    for verdict, rules in (("accept", policy.rules), ("reject", policy.deny)):
        for rule in rules:
            if rule.port is None:
                lines.append(f"ip daddr {rule.network} {verdict}")
            else:
                lines += [
                    f"ip daddr {rule.network} tcp dport {rule.port} {verdict}",
                    f"ip daddr {rule.network} udp dport {rule.port} {verdict}",
                ]
    lines.append("accept" if policy.mode == INTERNET else "reject")
    body = "\n        ".join(lines)
    return f"""
table inet sandbox
delete table inet sandbox
table inet sandbox {{
    chain output {{
        type filter hook output priority filter; policy drop;
        {body}
    }}{_header_rules(policy)}
}}
"""


def _header_rules(policy: NetworkPolicy) -> str:
    """The guest's connections to ports 80 and 443 of the addresses its policy sets
    headers for go to the header proxy listening in the namespace (but the proxy's own,
    which it marks). The filter then sees them go to the loopback; the proxy's own
    connection out is judged by the policy as the guest's would be."""
    networks = sorted({n for rule in policy.headers for n in rule.networks})
    if not networks:
        return ""
    address, port = HEADER_PROXY
    ports = ", ".join(str(p) for p in HEADER_PORTS)
    return f"""
    chain headers {{
        type nat hook output priority -100; policy accept;
        meta mark {HEADER_MARK:#x} return
        ip daddr {{ {", ".join(networks)} }} tcp dport {{ {ports} }} dnat ip to {address}:{port}
    }}"""


def _resolvers() -> list[str]:
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(words[1]).version == 4:
                        found.append(words[1])
    return found


async def attach(pid: int, policy: NetworkPolicy) -> Link | None:
    """Give the namespace of process ``pid`` its way out, as ``policy`` allows.

    :raises NetworkError: when the link or the rules cannot be made; a link made
        before the failure is deleted (a running VM given a policy by :func:`change`
        keeps its namespace: its slot must not stay taken), and a caller starting the
        VM ends it.
    """
    if policy.mode == NONE:
        return None
    # The steps that need nothing of each other at once: each starts a program (about
    # 10 ms here), and this is on the way of every start and restore. All end before
    # this returns or raises: none goes on after its caller stopped caring.
    done = await asyncio.gather(
        ensure_host_rules(), _new_link(pid), _host_addresses(), return_exceptions=True
    )
    _, link, host_addresses = done
    try:
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(link, Link) and isinstance(host_addresses, list)
        enter = ["nsenter", f"--net={namespace_path(pid)}", "--"]
        # The filters first, the route last: nothing leaves before the rules are in place.
        await _run([*enter, "nft", "-f", "-"], _sandbox_rules(policy, link, host_addresses))
        await _run(
            [*enter, "ip", "-batch", "-"],
            f"addr add {link.sandbox_address}/{PREFIX} dev eth0\nlink set eth0 up\n"
            f"route add default via {link.host_address}\n",
        )
    except BaseException:
        if isinstance(link, Link):
            await _drop_link(link)
        raise
    return link


async def _drop_link(link: Link) -> None:
    """Delete a link made for a setup that failed (its pair goes with it)."""
    with contextlib.suppress(NetworkError):
        await _run(["ip", "link", "del", link.name])


async def change(pid: int, link: Link | None, policy: NetworkPolicy) -> Link | None:
    """Put ``policy`` in force in the namespace of process ``pid`` (a running VM's),
    whose way out is ``link`` (None: it has none yet, its policy was ``"none"``).

    The filter is replaced in one transaction, then the namespace's connection tracking
    is emptied: a connection opened under the old policy is judged again by the new one
    at its next packet (one it no longer allows is cut, not let through as established).
    A namespace with no link gets one; one with a link keeps it whatever the policy
    (``"none"`` then refuses everything through it). Returns the link.

    :raises NetworkError: when the rules cannot be applied (the old ones stay).
    """
    if link is None:
        return await attach(pid, policy)
    if shutil.which("conntrack") is None:  # checked first: nothing changes without it
        raise NetworkError(
            "conntrack not found: a policy changed while the sandbox runs must also cut "
            "the connections it no longer allows; install Debian's conntrack "
            "(`make setup` does)"
        )
    enter = ["nsenter", f"--net={namespace_path(pid)}", "--"]
    await _run([*enter, "nft", "-f", "-"], _sandbox_rules(policy, link, await _host_addresses()))
    await _run([*enter, "conntrack", "-F"])
    return link


async def _host_addresses() -> list[str]:
    """Every IPv4 address the host has (on any interface), as /32s."""
    return addresses_of(await _run(["ip", "-j", "-4", "addr", "show"]))


async def _new_link(pid: int) -> Link:
    """A veth pair whose host end ``cbxN`` is free; N picks the sandbox's /30."""
    slots = SUBNET.num_addresses // 4
    first = random.randrange(slots)
    tries = min(slots, 64)
    for attempt in range(tries):
        slot = (first + attempt) % slots
        name = f"{LINK_PREFIX}{slot}"
        base = SUBNET.network_address + 4 * slot
        link = Link(name, str(base + 1), str(base + 2))
        try:  # one batch, which stops at its first failure
            await _run(
                ["ip", "-batch", "-"],
                f"link add {name} type veth peer name eth0 netns {pid}\n"
                f"addr add {link.host_address}/{PREFIX} dev {name}\nlink set {name} up\n",
            )
        except NetworkError as exc:
            if "exists" in str(exc):
                continue
            raise
        return link
    raise NetworkError(f"no free sandbox link in {SUBNET} after {tries} tries")


def open_namespace(pid: int) -> int:
    """A descriptor of process ``pid``'s namespace: it names that namespace for as long
    as it is open, even if the pid is reused."""
    return os.open(namespace_path(pid), os.O_RDONLY | os.O_CLOEXEC)


def socket_inside(namespace: int) -> socket.socket:
    """A TCP socket of the namespace open as ``namespace``: where it is made decides
    which namespace it binds and connects in (blocking: run it in a thread of its own;
    the switch affects this thread only, and it switches back)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(namespace)
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(own)
    finally:
        os.close(own)


def connect_inside(namespace: int, port: int, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to ``127.0.0.1:port`` inside the namespace open as ``namespace``
    (blocking: run it in a thread; the namespace switch affects this thread only)."""
    sock = socket_inside(namespace)
    try:
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
