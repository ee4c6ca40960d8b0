"""What a sandbox's guest may connect to, parsed from what a user writes.

``"internet"`` (the default): anywhere the host can reach, except the host itself, other
sandboxes and link-local addresses (cloud metadata services). ``"none"``: nothing at
all; ports forwarded from the host into the guest still work. A list of rules:
only those, each ``"HOST:PORT"``, ``"HOST"`` (every port), ``"CIDR"`` or
``"CIDR:PORT"``. ``{"allow": [...], "deny": [...]}``: the internet but what ``deny``
lists, and what ``allow`` lists in any case (an allowed destination wins over a denied
one, as E2B's ``allow_out``/``deny_out`` do; ``"deny": ["0.0.0.0/0"]`` with an allow
list is an allow list). Host names are resolved once, on the host, when the policy is
set (at create, or by :meth:`~cryobox.Sandbox.update_network`).

The dict form may also set headers on the guest's HTTP and HTTPS requests to some
destinations, as E2B's per-domain transforms do: ``{"headers": {"api.example.com":
{"Authorization": "Bearer ..."}}}`` (a name, an address or a CIDR; a header of the
same name the guest sent is replaced). The host's header proxy
(:mod:`cryobox.network.header_proxy`) does it, so the secret never enters the guest.
Setting headers for a destination does not allow it: the policy's other entries say
whether the guest reaches it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryobox.errors import InvalidArgument
from cryobox.models import NetworkJson
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


#: The most rules one policy holds (each is a line of the sandbox's filter).
MAX_RULES = 256


@dataclass(frozen=True)
class HeaderRule:
    """Requests to ``host`` get ``headers`` (each replacing one of its name the guest
    sent). A name matches by the request's TLS server name or ``Host``; an address or
    a CIDR, by where the connection goes. ``networks`` are where the guest's
    connections to ports 80 and 443 go through the host's header proxy: the name's
    addresses, resolved when the policy was set, or the address itself."""

    host: str
    networks: tuple[str, ...]
    headers: tuple[tuple[str, str], ...]

    @functools.cached_property
    def is_name(self) -> bool:
        return not _is_network(self.host)

    @functools.cached_property
    def _parsed(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(n) for n in self.networks)

    def reaches(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """Whether a connection to ``address`` goes where this rule's headers go."""
        return any(address in network for network in self._parsed)


#: Bounds of a policy's headers: per destination, and a value's length.
MAX_HEADERS = 64
MAX_HEADER_VALUE = 8192
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: RFC 9110's field value, as h11 sends it: no control character but a tab inside, no
#: space or tab at either end (h11 would refuse it at each request).
_VALUE = re.compile(r"(?:[^\x00-\x20\x7f](?:[^\x00-\x08\x0a-\x1f\x7f]*[^\x00-\x20\x7f])?)?")
#: Headers the proxy itself decides (framing, the connection): never set by a rule.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade"})


@dataclass(frozen=True)
class NetworkPolicy:
    """``mode`` says what is not listed: ``INTERNET`` goes out, ``ALLOW`` and ``NONE``
    do not. ``rules`` go out in any mode but ``NONE``; ``deny`` (of ``INTERNET`` only)
    does not, unless a rule allows it. ``headers`` (of ``INTERNET`` only) are set on
    requests to their destinations."""

    mode: str = INTERNET
    rules: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    headers: tuple[HeaderRule, ...] = ()

    def to_json(self) -> NetworkJson:
        if self.mode == INTERNET and (self.rules or self.deny or self.headers):
            form: dict[str, Any] = {
                "allow": [str(r) for r in self.rules],
                "deny": [str(r) for r in self.deny],
            }
            if self.headers:
                form["headers"] = {rule.host: dict(rule.headers) for rule in self.headers}
                form["resolved"] = {
                    rule.host: list(rule.networks) for rule in self.headers if rule.is_name
                }
            return form
        return self.mode if self.mode != ALLOW else [str(r) for r in self.rules]

    @classmethod
    def from_json(cls, value: Any) -> NetworkPolicy:
        """Read back what :meth:`to_json` wrote (names are already addresses)."""
        return parse_policy(value if value is not None else INTERNET, resolve=False)


def sets_headers(network: NetworkJson) -> bool:
    """Whether a policy's JSON form sets headers (its guest must trust the egress CA)."""
    return isinstance(network, dict) and bool(network.get("headers"))


FORMS = (
    "must be 'internet', 'none', a list of 'HOST:PORT', 'HOST', 'CIDR' or 'CIDR:PORT' "
    'entries (only those), or {"allow": [...], "deny": [...]} (the internet but the '
    'denied entries; allowed ones win), with "headers": {destination: {name: value}} '
    "if asked"
)


def parse_policy(value: Any, *, resolve: bool = True) -> NetworkPolicy:
    """The policy ``value`` asks for.

    :raises InvalidArgument: naming the entry that is not a mode or a rule.
    """
    if isinstance(value, str) and value in (INTERNET, NONE):
        return NetworkPolicy(mode=value)
    if isinstance(value, dict):
        return _parse_allow_deny(value, resolve)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"network {value!r}: {FORMS}")
    return NetworkPolicy(mode=ALLOW, rules=_parse_rules(value, resolve, allowed=True))


def _parse_allow_deny(value: dict[Any, Any], resolve: bool) -> NetworkPolicy:
    known = ("allow", "deny", "headers", "resolved")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidArgument(f"network: unknown key {unknown[0]!r}; {FORMS}")
    lists = {}
    for key in ("allow", "deny"):
        entries = value.get(key) or []
        if isinstance(entries, str) or not isinstance(entries, Sequence):
            raise InvalidArgument(f"network[{key!r}] {entries!r}: must be a list of entries")
        lists[key] = _parse_rules(entries, resolve, allowed=key == "allow")
    headers = _parse_headers(value.get("headers") or {}, value.get("resolved"), resolve)
    return NetworkPolicy(mode=INTERNET, rules=lists["allow"], deny=lists["deny"], headers=headers)


def _parse_headers(value: Any, resolved: Any, resolve: bool) -> tuple[HeaderRule, ...]:
    """``{destination: {name: value}}``; a name's addresses are those ``resolved`` gives
    (a policy read back, or a fork's; a name the host's DNS does not know), else looked
    up now."""
    if not isinstance(resolved, dict | None):
        raise InvalidArgument(f"network['resolved'] {resolved!r}: must map a name to addresses")
    resolved = resolved or {}
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"network['headers'] {value!r}: must map a destination to its headers, e.g. "
            '{"api.example.com": {"Authorization": "Bearer ..."}}'
        )
    if len(value) > MAX_RULES:
        raise InvalidArgument(f"network['headers']: {len(value)} destinations, at most {MAX_RULES}")
    found: list[HeaderRule] = []
    for host, headers in value.items():
        where = f"network['headers'][{host!r}]"
        if not isinstance(host, str) or not host or "*" in host or ":" in host:
            raise InvalidArgument(
                f"{where}: a destination is a host name, an address or a CIDR (no port, "
                "no wildcard)"
            )
        if _is_network(host):
            networks = tuple(rule.network for rule in _parse_rule(host, resolve=False))
        elif resolved.get(host):
            given = resolved[host]
            if isinstance(given, str) or not isinstance(given, Sequence):
                raise InvalidArgument(f"network['resolved'][{host!r}]: must be a list of addresses")
            networks = tuple(
                rule.network for entry in given for rule in _parse_rule(entry, resolve=False)
            )
        elif resolve:
            networks = tuple(rule.network for rule in _parse_rule(host, resolve=True))
        else:
            raise InvalidArgument(f"network['headers'][{host!r}]: its addresses are not kept")
        if resolve:
            for network in networks:
                _refuse_unreachable(host, ipaddress.IPv4Network(network))
        pairs = _parse_header_set(where, headers)
        found.append(HeaderRule(host.lower().rstrip("."), networks, pairs))
    return tuple(found)


def _parse_header_set(where: str, headers: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(headers, dict) or not headers:
        raise InvalidArgument(f"{where}: must be a non-empty map of header names to values")
    if len(headers) > MAX_HEADERS:
        raise InvalidArgument(f"{where}: {len(headers)} headers, at most {MAX_HEADERS}")
    pairs = []
    for name, text in headers.items():
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise InvalidArgument(f"{where}: {name!r} is not a header name")
        if name.lower() in _FRAMING:
            raise InvalidArgument(
                f"{where}: {name!r} is decided by the connection itself and cannot be set"
            )
        if not isinstance(text, str) or len(text) > MAX_HEADER_VALUE or not _VALUE.fullmatch(text):
            raise InvalidArgument(
                f"{where}[{name!r}]: a header value is text of at most {MAX_HEADER_VALUE} "
                "characters, without line breaks or control characters, and without spaces "
                "at either end"
            )
        pairs.append((name, text))
    return tuple(pairs)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _parse_rules(entries: Sequence[Any], resolve: bool, *, allowed: bool) -> tuple[Rule, ...]:
    if len(entries) > MAX_RULES:
        raise InvalidArgument(f"network: {len(entries)} entries, at most {MAX_RULES}")
    rules: list[Rule] = []
    for entry in entries:
        rules += _parse_rule(entry, resolve, allowed)
    return tuple(dict.fromkeys(rules))


def _parse_rule(entry: Any, resolve: bool, allowed: bool = True) -> list[Rule]:
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
    elif "*" in host:
        raise InvalidArgument(
            f"network entry {entry!r}: wildcard names are not supported (names are "
            "resolved once, on the host, when the policy is set); list the addresses"
        )
    else:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgument(
                f"network entry {entry!r}: cannot resolve {host!r} ({exc})"
            ) from exc
        rules = [Rule(f"{info[4][0]}/32", port) for info in infos]
    # A policy read back was checked when it was made; denying what is blocked anyway
    # misleads nobody.
    if resolve and allowed:
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
