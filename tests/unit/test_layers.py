"""The floors seen from a caller: a remote caller of the SDK and the CLI load no service,
sandbox or store module (the import contract in pyproject.toml checks the rest)."""

import subprocess
import sys

BELOW_THE_CLIENT = (
    "cryobox.service",
    "cryobox.sandbox",
    "cryobox.store",
    "cryobox.server",
    "cryobox.qemu",
    "cryobox.vmm",
    "cryobox.image",
    "cryobox.snapshot",
)


def loaded_after(code: str) -> str:
    """What a fresh interpreter prints after ``code`` (which may print itself)."""
    below = f"sorted(m for m in sys.modules if m.startswith({BELOW_THE_CLIENT!r}))"
    probe = f"import sys\n{code}\nprint({below})\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_importing_the_sdk_loads_no_service_sandbox_or_store_module() -> None:
    code = (
        "import cryobox\n"
        "cryobox.Sandbox, cryobox.AsyncSandbox, cryobox.SandboxNotFound\n"
        "from cryobox.client.transport import transport_for"
    )
    assert loaded_after(code) == "[]"


def test_the_cli_loads_the_service_only_for_the_commands_that_need_it() -> None:
    assert loaded_after("import cryobox.cli.main") == "[]"


def test_the_embedded_transport_loads_the_service_when_first_made() -> None:
    code = (
        "from cryobox.client.transport import LocalTransport\n"
        "assert 'cryobox.service' not in sys.modules\n"
        "print(type(LocalTransport().service).__module__)"
    )
    assert loaded_after(code).splitlines()[0] == "cryobox.service.service"


def test_the_cli_leaves_the_http_client_unloaded_until_a_server_is_named() -> None:
    """httpx is a tenth of a second of every embedded CLI call's start."""
    code = "import cryobox.cli.main\nprint('httpx' in sys.modules)"
    assert loaded_after(code).splitlines()[0] == "False"
