"""The domain service (:class:`SandboxService`): every operation cryobox offers, put
together by :func:`open_service`."""

from cryobox.service.compose import discard_spare, open_service, shared_launcher
from cryobox.service.service import SandboxService

__all__ = ["SandboxService", "discard_spare", "open_service", "shared_launcher"]
