"""The SDK's floor: a remote caller loads no service, sandbox or store module."""

import subprocess
import sys

PROBE = """
import sys
import cryobox
cryobox.Sandbox, cryobox.AsyncSandbox, cryobox.SandboxNotFound
from cryobox.client.transport import transport_for
below = ("cryobox.service", "cryobox.sandbox", "cryobox.store", "cryobox.server",
         "cryobox.qemu", "cryobox.vmm", "cryobox.image", "cryobox.snapshot")
print([m for m in sys.modules if m.startswith(below)])
"""


def test_importing_the_sdk_loads_no_service_sandbox_or_store_module() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_embedded_transport_loads_the_service_when_first_made() -> None:
    probe = (
        "import sys, asyncio\n"
        "from cryobox.client.transport import LocalTransport\n"
        "assert 'cryobox.service' not in sys.modules\n"
        "transport = LocalTransport()\n"
        "print(type(transport.service).__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "cryobox.service.service"


def test_the_cli_loads_the_service_only_for_the_commands_that_need_it() -> None:
    probe = (
        "import sys\n"
        "import cryobox.cli.main\n"
        "print([m for m in sys.modules if m.startswith(('cryobox.service', 'cryobox.sandbox',"
        " 'cryobox.store', 'cryobox.server'))])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
