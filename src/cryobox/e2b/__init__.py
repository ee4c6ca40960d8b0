"""The E2B-compatible API of ``cryobox server``: the official ``e2b`` SDK works against
it unchanged once ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` are ``http://HOST:PORT/e2b``
and ``E2B_API_KEY`` is a cryobox tenant key. :mod:`.rest` is E2B's control plane,
:mod:`.envd` its in-sandbox API; docs/COMPATIBILITY.md says what maps and what not."""
