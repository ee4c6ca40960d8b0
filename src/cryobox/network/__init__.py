"""Per-sandbox networks: what a guest may reach (:mod:`.policy`), the namespace that
enforces it (:mod:`.namespace`), and host ports forwarded into it (:mod:`.forward`)."""

from cryobox.network.policy import NetworkPolicy, parse_policy

__all__ = ["NetworkPolicy", "parse_policy"]
