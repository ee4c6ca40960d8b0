"""The host-guest channel: wire protocol, the in-guest agent, and the host-side client.

Everything here but ``client`` is standard library only: it is copied into the guest.
"""
