"""The addresses a sandbox's network is laid out in, and this host's own.

Both the policy (which refuses rules naming addresses no sandbox may reach) and the
namespace set-up (which gives each sandbox a link) need them; they live here so that
neither imports the other.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess

#: The addresses of sandbox links: a /30 per sandbox (host end .1, sandbox end .2).
SUBNET = ipaddress.IPv4Network(os.environ.get("CRYOBOX_SANDBOX_SUBNET", "10.213.0.0/16"))
#: The prefix length of each sandbox's /30.
PREFIX = 30
#: Link-local addresses (cloud metadata services) are never reachable from a sandbox.
LINK_LOCAL = "169.254.0.0/16"


def host_addresses() -> list[str]:
    """Every IPv4 address the host has (on any interface), as /32s ([] without ``ip``)."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return addresses_of(out)


def addresses_of(ip_json: str) -> list[str]:
    """The IPv4 addresses, as /32s, in the output of ``ip -j -4 addr show``."""
    found = []
    try:
        interfaces = json.loads(ip_json or "[]")
    except ValueError:
        return []
    for interface in interfaces:
        for info in interface.get("addr_info", []):
            if info.get("family") == "inet" and info.get("local"):
                found.append(f"{info['local']}/32")
    return found
