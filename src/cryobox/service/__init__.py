"""The domain service (:class:`SandboxService`): every operation cryobox offers."""

from cryobox.service.service import SandboxService, discard_spare

__all__ = ["SandboxService", "discard_spare"]
