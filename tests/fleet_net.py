"""Hosts of a test fleet on a network of their own: each ``cryobox server`` runs in a
network namespace the test makes, at an address of its own on one bridge, so that a
host's loss is a real loss of its address and a partition is a real one (its link
down: it reaches neither the database, the store, nor the other hosts, and nobody
reaches it).

The addresses are TEST-NET-2's (198.51.100.0/24, RFC 5737: never routed anywhere);
the hosts have no default route (only their /24), so nothing of theirs or of their
sandboxes leaves the bridge. The bridge lives in a namespace of its own (``cbfleet-PID-net``),
which this namespace joins as one more port (at :data:`GATEWAY`): bridged in this
namespace, the hosts' traffic to each other would pass this host's forward filters
(with ``br_netfilter`` loaded, every bridged packet does), and cryobox's own table
drops what it forwards for no sandbox. The database and the store, which the fixtures
run on this namespace's loopback, are reached from the hosts through small TCP relays
listening on :data:`GATEWAY` (:meth:`FleetNet.relay`). Everything is removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from types import TracebackType

#: This namespace's address on the fleet's network, where the relays listen.
GATEWAY = "198.51.100.1"


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class FleetNet:
    """Namespaces ``cbfleet-PID-NAME`` for hosts ``names`` (PID: this run's, so two
    runs on one machine keep apart), each with a veth pair whose outer end
    (``cfNAMEPID``) is on the bridge in namespace ``cbfleet-PID-net``; host N gets
    ``198.51.100.(11+N)``."""

    def __init__(self, names: str) -> None:
        self.names = names
        self._relays: list[_Relay] = []
        # Names of this run's own (a link's name: at most 15 characters).
        tag = f"{os.getpid() % 100000:05d}"
        self.fabric = f"cbfleet-{tag}-net"
        self.uplink = f"cfgw{tag}"
        self._tag = tag

    def namespace(self, name: str) -> str:
        return f"cbfleet-{self._tag}-{name}"

    def address(self, name: str) -> str:
        return f"198.51.100.{11 + self.names.index(name)}"

    def _link(self, name: str) -> str:
        return f"cf{name}{self._tag}"

    def __enter__(self) -> FleetNet:
        self._remove()  # what a run of this pid killed before its end may have left
        try:
            self._make()
        except BaseException:
            self._remove()
            raise
        return self

    def _make(self) -> None:
        fabric, uplink = self.fabric, self.uplink
        ip("netns", "add", fabric)
        ip("-n", fabric, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        ip("-n", fabric, "link", "set", "br0", "up")
        ip("link", "add", uplink, "type", "veth", "peer", "name", "up0", "netns", fabric)
        ip("-n", fabric, "link", "set", "up0", "master", "br0")
        ip("-n", fabric, "link", "set", "up0", "up")
        ip("addr", "add", f"{GATEWAY}/24", "dev", uplink)
        ip("link", "set", uplink, "up")
        for name in self.names:
            ns, link = self.namespace(name), self._link(name)
            ip("netns", "add", ns)
            ip("-n", fabric, "link", "add", link, "type", "veth", "peer", "name", "eth0")
            ip("-n", fabric, "link", "set", "eth0", "netns", ns)
            ip("-n", fabric, "link", "set", link, "master", "br0")
            ip("-n", fabric, "link", "set", link, "up")
            ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")  # (no default route: see above)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for relay in self._relays:
            relay.close()
        self._remove()

    def _remove(self) -> None:
        for ns in (self.fabric, *(self.namespace(name) for name in self.names)):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.uplink], capture_output=True)

    def relay(self, port: int) -> int:
        """Relay the bridge's address, at a port of its own, to ``127.0.0.1:port`` (a
        service the fixtures run here); that port."""
        relay = _Relay(port)
        self._relays.append(relay)
        return relay.port

    def cut(self, name: str) -> None:
        """Partition host ``name``: its link down (its processes run on, alone)."""
        ip("-n", self.fabric, "link", "set", self._link(name), "down")

    def heal(self, name: str) -> None:
        ip("-n", self.fabric, "link", "set", self._link(name), "up")


class _Relay:
    """A TCP relay from ``GATEWAY:<any port>`` to ``127.0.0.1:target``: a thread per
    direction of each connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server((GATEWAY, 0))
        self.port = int(self.listener.getsockname()[1])
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, name="fleet-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                far = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                near.close()
                continue
            far.settimeout(None)
            self._open += [near, far]
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
