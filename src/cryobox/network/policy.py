"""What a sandbox's guest may connect to, parsed from what a user writes.

``"internet"`` (the default): anywhere the host can reach, except the host itself, other
sandboxes and link-local addresses (cloud metadata services). ``"none"``: nothing at
all; ports forwarded from the host into the guest still work. A list of rules:
only those, each ``"HOST:PORT"``, ``"HOST"`` (every port), ``"CIDR"`` or
``"CIDR:PORT"``; host names are resolved once, on the host, when the sandbox is created.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryobox.errors import InvalidArgument
from cryobox.network.addresses import SUBNET, host_addresses

INTERNET = "internet"
NONE = "none"
ALLOW = "allow"


@dataclass(frozen=True)
class Rule:
    """Connections to ``network`` (on ``port`` only, when given) are allowed."""

    network: str
    port: int | None = None

    def __str__(self) -> str:
        return self.network if self.port is None else f"{self.network}:{self.port}"


@dataclass(frozen=True)
class NetworkPolicy:
    mode: str = INTERNET
    rules: tuple[Rule, ...] = ()

    def to_json(self) -> str | list[str]:
        return self.mode if self.mode != ALLOW else [str(r) for r in self.rules]

    @classmethod
    def from_json(cls, value: Any) -> NetworkPolicy:
        """Read back what :meth:`to_json` wrote (names are already addresses)."""
        return parse_policy(value if value is not None else INTERNET, resolve=False)


def parse_policy(value: Any, *, resolve: bool = True) -> NetworkPolicy:
    """The policy ``value`` asks for.

    :raises InvalidArgument: naming the entry that is not a mode or a rule.
    """
    if isinstance(value, str) and value in (INTERNET, NONE):
        return NetworkPolicy(mode=value)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(
            f"network {value!r}: must be 'internet', 'none' or a list of "
            "'HOST:PORT', 'HOST', 'CIDR' or 'CIDR:PORT' entries"
        )
    rules: list[Rule] = []
    for entry in value:
        rules += _parse_rule(entry, resolve)
    return NetworkPolicy(mode=ALLOW, rules=tuple(dict.fromkeys(rules)))


def _parse_rule(entry: Any, resolve: bool) -> list[Rule]:
    if not isinstance(entry, str) or not entry or entry.strip() != entry:
        raise InvalidArgument(f"network entry {entry!r}: must be a non-empty string")
    host, port = entry, None
    if entry.count(":") == 1:  # IPv6 is not offered to guests: one colon means a port
        host, _, text = entry.partition(":")
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            raise InvalidArgument(f"network entry {entry!r}: port must be 1-65535")
        port = int(text)
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        net = None
    if net is not None:
        if net.version != 4:
            raise InvalidArgument(f"network entry {entry!r}: only IPv4 is offered to guests")
        rules = [Rule(str(net), port)]
    elif not resolve:
        raise InvalidArgument(f"network entry {entry!r}: not an address")
    else:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgument(
                f"network entry {entry!r}: cannot resolve {host!r} ({exc})"
            ) from exc
        rules = [Rule(f"{info[4][0]}/32", port) for info in infos]
    if resolve:  # a policy read back was checked when it was made
        for rule in rules:
            _refuse_unreachable(entry, ipaddress.IPv4Network(rule.network))
    return rules


#: Destinations no sandbox ever reaches, whatever its policy (see
#: :func:`cryobox.network.namespace._sandbox_rules`), with what they are.
NEVER_REACHED = (
    (ipaddress.IPv4Network("127.0.0.0/8"), "the loopback (the guest's own, never the host's)"),
    (ipaddress.IPv4Network("0.0.0.0/8"), "no address (it means this host)"),
    (ipaddress.IPv4Network("169.254.0.0/16"), "link-local (cloud metadata services)"),
    (ipaddress.IPv4Network("224.0.0.0/4"), "multicast"),
    (ipaddress.IPv4Network("255.255.255.255/32"), "the broadcast address"),
)


def _refuse_unreachable(entry: str, net: ipaddress.IPv4Network) -> None:
    """Refuse a rule every address of which is blocked anyway: the user would believe
    the guest reaches it. A wider rule that merely contains such addresses is kept (the
    blocked part stays blocked)."""
    never = [
        *NEVER_REACHED,
        (SUBNET, "the sandboxes' own links (other sandboxes)"),
        *((ipaddress.IPv4Network(a), "an address of this host") for a in host_addresses()),
    ]
    for blocked, what in never:
        if net.subnet_of(blocked):
            raise InvalidArgument(
                f"network entry {entry!r}: {net} is {what}, which no sandbox may reach; "
                "to reach a port of the guest from the host, use ports="
            )
