"""The ``cryobox`` command: a client of the SDK, nothing more.

Every command maps to an SDK call; errors are printed as one red line naming what
went wrong, with exit code 1 (a command run in a sandbox passes its own exit code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import typer

from cryobox import config
from cryobox.arguments import key_values
from cryobox.bench import SCENARIOS
from cryobox.client import Sandbox
from cryobox.errors import CommandNotFound, CryoboxError, InvalidArgument, SandboxNotFound
from cryobox.models import LineageNode
from cryobox.util import host_memory_mib

from .mcp_command import mcp
from .output import console, errors_reported, out, print_rows, say_error
from .pool_commands import pool_app, print_members
from .process_commands import process_app
from .server_commands import host_app, server, tenant_app, usage
from .store_commands import gc, key_app, snapshot_app, store_app
from .terminal import run_on_terminal, stdin_fd
from .volume_commands import volume_app

app = typer.Typer(no_args_is_help=True, help="Real VM sandboxes for AI agents.")


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version  # 17 ms of every other command's start

        print(f"cryobox {version('cryobox')}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Real VM sandboxes for AI agents."""


image_app = typer.Typer(no_args_is_help=True, help="The guest image built from Debian packages.")
app.add_typer(image_app, name="image")
template_app = typer.Typer(no_args_is_help=True, help="Templates: saved machines to start from.")
app.add_typer(template_app, name="template")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(store_app, name="store")
app.add_typer(key_app, name="key")
app.add_typer(pool_app, name="pool")
app.add_typer(volume_app, name="volume")
app.add_typer(process_app, name="proc")

CpusOption = Annotated[int, typer.Option("--cpus", help="vCPUs.")]
MemoryOption = Annotated[int, typer.Option("--memory", help="RAM in MiB.")]
DiskOption = Annotated[int, typer.Option("--disk", help="Disk size in GiB.")]
ShapeCpus = Annotated[int | None, typer.Option("--cpus", help="vCPUs (template's if omitted).")]
ShapeMemory = Annotated[
    int | None, typer.Option("--memory", help="RAM in MiB (template's if omitted).")
]
ShapeDisk = Annotated[int | None, typer.Option("--disk", help="Disk GiB (template's if omitted).")]
TemplateOption = Annotated[
    str, typer.Option("--template", "-t", help="default (restore), base (cold boot), or a name.")
]
FromSnapshotOption = Annotated[
    str | None, typer.Option("--from-snapshot", help="Start from a saved snapshot (id or name).")
]
TimeoutOption = Annotated[
    float, typer.Option("--timeout", help="Seconds until the sandbox is killed unless extended.")
]
NetworkOption = Annotated[
    str,
    typer.Option(
        "--network",
        help="What the guest may reach: internet, none, or comma-separated "
        "HOST:PORT / HOST / CIDR / CIDR:PORT entries.",
    ),
]
PortOption = Annotated[
    list[int] | None, typer.Option("--port", "-p", help="Guest TCP port to forward (repeatable).")
]
LabelOption = Annotated[
    list[str] | None,
    typer.Option("--label", "-l", help="KEY=VALUE label kept with the sandbox (repeatable)."),
]
SandboxEnvOption = Annotated[
    list[str] | None,
    typer.Option("--env", "-e", help="NAME=VALUE every command gets (repeatable)."),
]


def network_text(text: str) -> str | list[str]:
    """A policy as the CLI takes it: ``internet``, ``none``, or comma-separated entries."""
    return text if text in ("internet", "none") else text.split(",")


def header_sets(entries: list[str]) -> dict[str, dict[str, dict[str, str]]]:
    """``--header DESTINATION:NAME=VALUE`` entries as a policy's ``headers``."""
    found: dict[str, dict[str, str]] = {}
    for entry in entries:
        where, colon, setting = entry.partition(":")
        name, equals, value = setting.partition("=")
        if not (where and colon and name and equals):
            raise InvalidArgument(f"--header {entry!r}: must be DESTINATION:NAME=VALUE")
        found.setdefault(where, {})[name] = value
    return {"headers": found} if found else {}


def create_sandbox(
    cpus: int | None,
    memory: int | None,
    disk: int | None,
    timeout: float,
    ports: list[int] | None,
    template: str = "default",
    from_snapshot: str | None = None,
    network: str = "internet",
    env: list[str] | None = None,
    label: list[str] | None = None,
    proxy: str | None = None,
    ca_bundle: str | None = None,
    *,
    checkpoint_every: float = 0,
    keep_checkpoints: int | None = None,
    volume: list[str] | None = None,
    on_timeout: str = "kill",
) -> Sandbox:
    envs, metadata = key_values("--env", env or []), key_values("--label", label or [])
    volumes = key_values("--volume", volume or [])
    if on_timeout not in ("kill", "pause"):
        raise InvalidArgument(f"--on-timeout {on_timeout!r}: must be kill or pause")
    with console.status("starting sandbox (building the guest image first if needed)") as status:
        return Sandbox.create(
            template,
            envs=envs,
            metadata=metadata,
            from_snapshot=from_snapshot,
            cpus=cpus,
            memory_mib=memory,
            disk_gib=disk,
            timeout=timeout,
            on_timeout="pause" if on_timeout == "pause" else "kill",
            ports=ports or [],
            network=network_text(network),
            proxy=proxy,
            ca_bundle=ca_bundle,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            volumes=volumes,
            progress=lambda step: status.update(step),
        )


@app.command()
def create(
    template: TemplateOption = "default",
    from_snapshot: FromSnapshotOption = None,
    cpus: ShapeCpus = None,
    memory: ShapeMemory = None,
    disk: ShapeDisk = None,
    timeout: TimeoutOption = config.DEFAULT_TIMEOUT,
    port: PortOption = None,
    network: NetworkOption = "internet",
    env: SandboxEnvOption = None,
    label: LabelOption = None,
    proxy: Annotated[
        str | None,
        typer.Option(help="The guest's HTTP(S) proxy URL ('' for none; default: the host's)."),
    ] = None,
    ca_bundle: Annotated[
        str | None,
        typer.Option(
            help="A PEM file of CAs the guest trusts too ('' for none; default: the host's own)."
        ),
    ] = None,
    checkpoint_every: Annotated[
        float,
        typer.Option(
            help="Checkpoint it every SECONDS (5 or more) while it runs: `cryobox history` "
            "lists them, `cryobox rewind` goes back. 0: never."
        ),
    ] = 0,
    keep_checkpoints: Annotated[
        int | None,
        typer.Option(help="With --checkpoint-every: how many to keep, the newest (default 10)."),
    ] = None,
    volume: Annotated[
        list[str] | None,
        typer.Option(
            "--volume",
            "-v",
            help="PATH=NAME: mount named volume NAME at PATH (NAME:ro read-only; repeatable).",
        ),
    ] = None,
    on_timeout: Annotated[
        str,
        typer.Option(
            help="What --timeout does: kill it, or pause it (the whole machine kept, for "
            "`cryobox resume`)."
        ),
    ] = "kill",
) -> None:
    """Start a sandbox and print its id."""
    with errors_reported():
        sbx = create_sandbox(
            cpus,
            memory,
            disk,
            timeout,
            port,
            template,
            from_snapshot,
            network,
            env,
            label,
            proxy,
            ca_bundle,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            volume=volume,
            on_timeout=on_timeout,
        )
        for guest, host in sbx.ports.items():
            console.print(f"port {guest} -> 127.0.0.1:{host}")
        out.print(sbx.id)
        sbx.close()


def run_in(
    sbx: Sandbox,
    command: list[str],
    shell: str | None,
    env: list[str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    interactive: bool = False,
) -> int:
    """Run a command with its output streamed to ours, and with ``interactive`` our
    stdin streamed to its stdin; its exit code (127 when the program does not exist)."""
    if shell is None and not command:
        raise InvalidArgument("give a command after --, or --shell 'CMD'")
    variables = key_values("--env", env or [])
    try:
        handle = sbx.commands.run(
            shell if shell is not None else command,
            background=True,
            stdin=interactive,
            env=variables,
            cwd=cwd,
            user=user,
            timeout=timeout,
            on_stdout=lambda text: (sys.stdout.write(text), sys.stdout.flush()),
            on_stderr=lambda text: (sys.stderr.write(text), sys.stderr.flush()),
        )
    except CommandNotFound as exc:  # as a shell says it: exit code 127
        say_error(exc)
        return 127
    if interactive:
        # Fed from a thread: the command may end before our stdin does (`yes | head -1`),
        # and its exit code is what we wait for, not the end of our input.
        threading.Thread(target=_feed, args=(handle,), daemon=True).start()
    try:
        result = handle.wait()
    except KeyboardInterrupt:  # Ctrl-C here stops the command there
        with contextlib.suppress(CryoboxError):
            handle.kill()
        raise typer.Exit(130) from None
    if result.timed_out:
        console.print(f"[yellow]command timed out after {timeout} s[/yellow]")
    return result.exit_code


def _feed(handle: Any) -> None:
    """Our stdin to the command's, then its end; stops quietly when the command has
    stopped reading (it ended, or closed its stdin)."""
    fd = stdin_fd()
    try:
        if fd >= 0:
            for chunk in iter(lambda: os.read(fd, 65536), b""):
                handle.send_stdin(chunk)
        handle.send_stdin(b"", eof=True)
    except (CryoboxError, OSError):
        pass  # the command no longer takes input: its exit code still counts


ShellOption = Annotated[
    str | None, typer.Option("--shell", "-c", help="A command line, run with /bin/sh -c.")
]
EnvOption = Annotated[
    list[str] | None, typer.Option("--env", "-e", help="NAME=VALUE (repeatable).")
]
CwdOption = Annotated[str | None, typer.Option("--cwd", help="Working directory in the guest.")]
UserOption = Annotated[str | None, typer.Option("--user", help="Guest user to run as.")]
CommandTimeout = Annotated[
    float | None, typer.Option("--command-timeout", help="Kill the command after N s.")
]
CommandArgs = Annotated[
    list[str] | None, typer.Argument(help="The command and its arguments, after --.")
]
InteractiveOption = Annotated[
    bool, typer.Option("--interactive", "-i", help="Pass this terminal's stdin to the command.")
]
TtyOption = Annotated[
    bool,
    typer.Option(
        "--tty", "-t", help="Run it on a terminal (a PTY): colours, prompts, Ctrl-C, resize."
    ),
]


def refuse_without_terminal(what: str, instead: str) -> None:
    """Refuse at once, as docker does, when stdin is not a terminal: a terminal session
    fed from a pipe never sees its end and would wait forever."""
    if not sys.stdin.isatty():
        raise InvalidArgument(f"{what}: the input is not a terminal ({instead})")


@app.command("exec")
def exec_(
    sandbox_id: str,
    command: CommandArgs = None,
    shell: ShellOption = None,
    env: EnvOption = None,
    cwd: CwdOption = None,
    user: UserOption = None,
    command_timeout: CommandTimeout = None,
    interactive: InteractiveOption = False,
    tty: TtyOption = False,
) -> None:
    """Run a command in a sandbox; exits with the command's exit code (`exec -it ID --
    python3` for an interactive program)."""
    with errors_reported():
        if tty and interactive:
            refuse_without_terminal("exec -it", "use exec -i (without -t) to pipe input")
        sbx = Sandbox.connect(sandbox_id)
        if tty:
            if shell is None and not command:
                raise InvalidArgument("give a command after --, or --shell 'CMD'")
            code = run_on_terminal(
                sbx,
                shell if shell is not None else command or [],
                forward_input=interactive,
                env=key_values("--env", env or []),
                cwd=cwd,
                user=user,
                timeout=command_timeout,
            )
        else:
            code = run_in(sbx, command or [], shell, env, cwd, user, command_timeout, interactive)
        sbx.close()
    raise typer.Exit(code)


@app.command("shell")
def shell_(
    sandbox_id: str,
    env: EnvOption = None,
    cwd: CwdOption = None,
    user: UserOption = None,
) -> None:
    """An interactive login shell in a sandbox (bash on a terminal); exits with its code."""
    with errors_reported():
        refuse_without_terminal("shell", "use exec -i ID -- bash to pipe a script to a shell")
        sbx = Sandbox.connect(sandbox_id)
        code = run_on_terminal(
            sbx,
            ["/bin/bash", "-l"],
            forward_input=True,
            env=key_values("--env", env or []),
            cwd=cwd,
            user=user,
        )
        sbx.close()
    raise typer.Exit(code)


@app.command()
def run(
    command: CommandArgs = None,
    shell: ShellOption = None,
    env: EnvOption = None,
    cwd: CwdOption = None,
    template: TemplateOption = "default",
    cpus: ShapeCpus = None,
    memory: ShapeMemory = None,
    disk: ShapeDisk = None,
    timeout: TimeoutOption = config.DEFAULT_TIMEOUT,
) -> None:
    """Create a sandbox, run one command in it, kill it: `cryobox run -- python3 -V`."""
    with errors_reported():
        sbx = create_sandbox(cpus, memory, disk, timeout, None, template)
        try:
            code = run_in(sbx, command or [], shell, env, cwd, None, None)
        finally:
            sbx.kill()
    raise typer.Exit(code)


def split_remote(location: str) -> tuple[str | None, str]:
    """``ID:/path`` (any id or unique prefix the other commands take) -> (id, path); a
    host path -> (None, path). As ``docker cp`` reads it: a colon before any ``/`` names
    a sandbox (write ``./a:b`` for a host file whose name has one)."""
    head, sep, tail = location.partition(":")
    if sep and head and "/" not in head:
        return head, tail
    return None, location


@app.command()
def cp(
    source: str,
    destination: str,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Copy a folder and everything in it.")
    ] = False,
) -> None:
    """Copy into or out of a sandbox: `cryobox cp ./a sbx-ID:/root/a` (or the reverse).

    As cp does: into an existing folder, the copy is named after its source; a folder
    needs -r. Symlinks are not copied (each is named). Files keep their mode.
    """
    from .copy_tree import download_tree, upload_tree  # tarfile: only when copying

    with errors_reported():
        (src_id, src_path), (dst_id, dst_path) = split_remote(source), split_remote(destination)
        if (src_id is None) == (dst_id is None):
            raise InvalidArgument("exactly one side must be SANDBOX_ID:/path")
        if src_id is not None:
            sbx = Sandbox.connect(src_id)
            try:
                is_dir = sbx.files.stat(src_path).type == "dir"
            except FileNotFoundError as missing:
                told = f"{source}: no such file or folder in the sandbox"
                raise InvalidArgument(told) from missing
            if is_dir and not recursive:
                raise InvalidArgument(f"{source} is a folder: copy it with -r")
            target = Path(dst_path)
            if target.is_dir():
                target = target / PurePosixPath(src_path.rstrip("/")).name
            if is_dir:
                copied = download_tree(sbx, src_path, target, _skipped)
                out.print(f"copied {copied} file{'' if copied == 1 else 's'}")
            else:
                sbx.files.download(src_path, target)
                out.print("copied 1 file")
        else:
            assert dst_id is not None
            sbx = Sandbox.connect(dst_id)
            local = Path(src_path)
            if local.is_dir() and not recursive:
                raise InvalidArgument(f"{source} is a folder: copy it with -r")
            remote = dst_path
            if remote.endswith("/") or (
                sbx.files.exists(remote) and sbx.files.stat(remote).type == "dir"
            ):
                remote = remote.rstrip("/") + "/" + local.resolve().name
            if local.is_dir():
                copied = upload_tree(sbx, local, remote, _skipped)
                out.print(f"copied {copied} file{'' if copied == 1 else 's'}")
            else:
                sbx.files.upload(src_path, remote)
                out.print("copied 1 file")
        sbx.close()


def _skipped(what: str) -> None:
    console.print(f"skipped {what}", highlight=False)


StateOption = Annotated[
    str | None,
    typer.Option("--state", help="Only sandboxes in this state (running, paused, killed...)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON, whole records.")]
LabelFilter = Annotated[
    list[str] | None,
    typer.Option("--label", "-l", help="Only sandboxes with this KEY=VALUE (repeatable)."),
]


@app.command("ls")
def list_(
    all: Annotated[bool, typer.Option("--all", "-a", help="Include killed and dead ones.")] = False,
    state: StateOption = None,
    label: LabelFilter = None,
    as_json: JsonOption = False,
    pooled: Annotated[
        bool,
        typer.Option("--pool", help="List the warm pools' waiting sandboxes and their memory."),
    ] = False,
) -> None:
    """List sandboxes on this host (tab-separated when piped)."""
    if pooled:
        with errors_reported():
            print_members(as_json)
        return
    with errors_reported():
        found = Sandbox.list(all=all, state=state, metadata=key_values("--label", label or []))
        if as_json:
            print(json.dumps([dataclasses.asdict(info) for info in found], indent=2))
            return
        now = time.time()
        header = (
            "ID",
            "STATE",
            "CPUS",
            "MEMORY",
            "ACCEL",
            "AGE",
            "EXPIRES",
            "PORTS",
            "LABELS",
            "NOTE",
        )
        rows = []
        for info in found:
            running = info.deadline and info.state == "running"
            rows.append(
                (
                    info.id,
                    info.state,
                    str(info.cpus),
                    f"{info.memory_mib}MiB",
                    info.accelerator,
                    f"{now - info.created_at:.0f}s",
                    f"{info.deadline - now:.0f}s" if info.deadline and running else "-",
                    ",".join(f"{g}->{h}" for g, h in info.ports.items()) or "-",
                    ",".join(f"{k}={v}" for k, v in info.metadata.items()) or "-",
                    (info.error or "").splitlines()[0][:80]
                    if info.error
                    else f"VM held {info.held_until - now:.0f}s more"
                    if info.held_until
                    else "",
                )
            )
        print_rows(header, rows)


@app.command()
def info(sandbox_id: str, as_json: JsonOption = False) -> None:
    """Show one sandbox (it stays as it is: a paused one is not resumed)."""
    with errors_reported():
        found = Sandbox.connect(sandbox_id, resume=False).info()
        record = dataclasses.asdict(found)
        # What it holds on this host, when it runs here (PSS: shared pages split).
        held = host_memory_mib((found.vmm_pid, found.supervisor_pid))
        record["host_memory_mib"] = None if held is None else round(held, 1)
        if as_json:
            print(json.dumps(record, indent=2))
            return
        print_rows(("FIELD", "VALUE"), [(k, _shown(v)) for k, v in record.items()])


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def _print_new(shown: str, now: str, *, whole_lines: bool) -> str:
    """Print what ``now`` has past ``shown`` (all of it when the log was rotated, and then
    starts again); with ``whole_lines``, only up to its last newline (the rest may be a
    line, or a character, still being written). What has been shown now."""
    start = len(shown) if now.startswith(shown) else 0
    end = now.rfind("\n") + 1 if whole_lines else len(now)
    if end > start:
        sys.stdout.write(now[start:end])  # as the guest wrote it: never re-wrapped
        sys.stdout.flush()
        return now[:end]
    return shown if start else ""


#: Seconds between two looks at a followed log; the states in which it can still grow.
FOLLOW_INTERVAL = 0.5
FOLLOWED_STATES = ("creating", "running", "resuming")


@app.command()
def logs(
    sandbox_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Go on printing what comes, until it ends.")
    ] = False,
) -> None:
    """Print a sandbox's serial console: the guest kernel's and agent's lines (a restored
    or forked sandbox's starts with its source's, and says what it continues)."""
    with errors_reported():
        sbx = Sandbox.connect(sandbox_id, resume=False)
        shown = _print_new("", sbx.logs(), whole_lines=follow)
        try:
            while follow:
                time.sleep(FOLLOW_INTERVAL)
                try:
                    state = sbx.info().state
                    now = sbx.logs()  # after the state: a final state's last lines are in
                except SandboxNotFound:
                    console.print(f"[dim]-- {sbx.id} is gone[/dim]")
                    break
                final = state not in FOLLOWED_STATES
                shown = _print_new(shown, now, whole_lines=not final)
                if final:
                    console.print(f"[dim]-- {sbx.id} is {state}[/dim]")
                    break
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


@app.command()
def kill(
    sandbox_ids: Annotated[list[str] | None, typer.Argument(help="Sandbox ids.")] = None,
    all: Annotated[
        bool, typer.Option("--all", help="Every running or paused sandbox (with --label: those).")
    ] = False,
    label: Annotated[
        list[str] | None,
        typer.Option("--label", "-l", help="With --all: only those with this KEY=VALUE."),
    ] = None,
) -> None:
    """Kill sandboxes (or remove what is left of dead ones)."""
    with errors_reported():
        if label and not all:
            raise InvalidArgument("--label selects among --all: give both, or ids")
        if all == bool(sandbox_ids):
            raise InvalidArgument("give sandbox ids, or --all (with --label to narrow it)")
        targets = list(sandbox_ids or [])
        if all:
            wanted = key_values("--label", label or [])
            targets = [info.id for info in Sandbox.list(metadata=wanted)]
        failed = 0
        for sandbox_id in targets:
            try:
                doomed = Sandbox.connect(sandbox_id, resume=False)
                doomed.kill()
            except CryoboxError as exc:  # one that went meanwhile must not stop the rest
                say_error(exc)
                failed += 1
                continue
            out.print(f"killed {doomed.id}")
        if all and not targets:
            console.print("no sandbox to kill")
        if failed:
            raise typer.Exit(1)


#: Arguments that begin with "-" (a negative number) are values, not unknown options.
NUMBERS = {"ignore_unknown_options": True}


@app.command("set-timeout", context_settings=NUMBERS)
def set_timeout(sandbox_id: str, seconds: float) -> None:
    """Kill the sandbox SECONDS from now unless extended again."""
    with errors_reported():
        # A bad value is refused before a paused sandbox is resumed for it.
        Sandbox.connect(sandbox_id, resume=False).set_timeout(seconds)


@app.command("network")
def network_(
    sandbox_id: str,
    policy: Annotated[
        str | None,
        typer.Argument(
            help="internet, none, or comma-separated HOST:PORT / HOST / CIDR / CIDR:PORT "
            "entries (only those)."
        ),
    ] = None,
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", help="An entry that gets out whatever is denied (repeatable)."),
    ] = None,
    deny: Annotated[
        list[str] | None,
        typer.Option("--deny", help="An entry that does not get out (repeatable)."),
    ] = None,
    header: Annotated[
        list[str] | None,
        typer.Option(
            "--header",
            help="DESTINATION:NAME=VALUE set by the host on the guest's HTTP(S) requests to "
            "DESTINATION (a host name, an address or a CIDR); the guest never sees VALUE "
            "(repeatable).",
        ),
    ] = None,
) -> None:
    """Change what a running sandbox's guest may reach, at once (no restart); print the
    policy kept. `--deny 0.0.0.0/0 --allow HOST` lets only HOST out."""
    with errors_reported():
        if (policy is None) == (not allow and not deny and not header):
            raise InvalidArgument("give a POLICY, or --allow/--deny/--header entries (not both)")
        wanted: str | list[str] | dict[str, Any] = (
            {"allow": allow or [], "deny": deny or [], **header_sets(header or [])}
            if policy is None
            else network_text(policy)
        )
        kept = Sandbox.connect(sandbox_id).update_network(wanted)
        out.print(kept if isinstance(kept, str) else json.dumps(kept), soft_wrap=True)


@app.command()
def port(sandbox_id: str, guest_port: int) -> None:
    """Forward a guest TCP port to 127.0.0.1 and print the host port."""
    with errors_reported():
        out.print(Sandbox.connect(sandbox_id).expose_port(guest_port))


@image_app.command("build")
def image_build() -> None:
    """Build the guest image (cached by content key; a no-op when it is current)."""
    from cryobox.image import ensure_image

    with errors_reported(), console.status("building guest image") as status:
        image = ensure_image(lambda step: status.update(f"building guest image: {step}"))
    out.print(f"image {image.id} at {image.path}")


@image_app.command("ls")
def image_ls() -> None:
    """List the images imported from container images (tab-separated when piped)."""
    from cryobox.image.oci import imported_images

    with errors_reported():
        rows = [
            (
                image.id,
                str(image.manifest["container"].get("reference", "")),
                f"{image.manifest.get('sizes', {}).get('rootfs.qcow2', 0) / 1e6:.0f} MB",
                str(image.manifest.get("created", "")),
            )
            for image in imported_images()
        ]
        print_rows(("IMAGE", "FROM", "SIZE", "CREATED"), rows)


@image_app.command("rm")
def image_rm(image_ids: list[str]) -> None:
    """Delete images imported from container images (refused while a template, snapshot
    or sandbox of this host boots from one)."""
    from cryobox.service import open_service

    with errors_reported():
        service = open_service()
        for image_id in image_ids:
            service.remove_image(image_id)
            out.print(f"removed {image_id}")


@image_app.command("prune")
def image_prune(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would go; remove nothing.")
    ] = False,
    unused_for: Annotated[
        float,
        typer.Option(
            "--unused-for",
            min=0,
            help="Keep an image a start loaded within this many minutes.",
        ),
    ] = config.IMAGE_UNUSED_FOR / 60,
) -> None:
    """Delete the guest images other than the current one that no template, snapshot or
    sandbox of this host (this state directory) boots from, and what only they used in
    the cache. The current image, and imports on it, are kept."""
    from cryobox.image.prune import describe
    from cryobox.service import open_service

    with errors_reported():
        plan = open_service().prune_images(unused_for=unused_for * 60, dry_run=dry_run)
        outcome = "would remove" if dry_run else "removed"
        rows = [
            (
                p.image_id,
                p.kind,
                f"{p.size / 1e6:.0f} MB",
                "kept: used by " + ", ".join(p.users[:3]) + (" ..." if len(p.users) > 3 else "")
                if p.kept
                else outcome,
            )
            for p in plan.images
        ]
        if rows:
            print_rows(("IMAGE", "KIND", "SIZE", "OUTCOME"), rows)
        else:
            console.print("no guest image but the current one (and imports on it) is here")
        console.print(f"{outcome} {describe(plan)}")


@image_app.command("info")
def image_info() -> None:
    """Show the current image's key, versions and sizes."""
    from cryobox.image import find_image, image_key

    with errors_reported():
        key = image_key()
        image = find_image(key["id"])
        rows = [
            ("id", key["id"]),
            ("built", f"yes, at {image.path}" if image else "no (run `cryobox image build`)"),
            ("kernel", f"{key['kernel_package']} {key['kernel_version']}"),
            *key["rootfs"]["packages"].items(),
        ]
        if image:
            rows += [
                (name, f"{size / 1e6:.1f} MB") for name, size in image.manifest["sizes"].items()
            ]
            rows.append(("created", image.manifest["created"]))
            criu = image.manifest.get("criu") or {}
            rows.append(
                (
                    "process checkpoints",
                    f"criu {criu['version']}, kernel {criu['kernel']}" if criu else "no criu",
                )
            )
        print_rows(("FIELD", "VALUE"), rows)  # (tab-separated when piped, as every list)


@app.command()
def pause(
    sandbox_id: str,
    disk_only: Annotated[
        bool,
        typer.Option(
            "--disk-only",
            help="Keep its disk only (files flushed): no process survives; resume boots it.",
        ),
    ] = False,
) -> None:
    """Save a sandbox's whole machine and stop it (no CPU, no RAM); resume continues it."""
    with errors_reported():
        sbx = Sandbox.connect(sandbox_id, resume=False)
        sbx.pause(memory=not disk_only)
        out.print(f"paused {sbx.id}" + (" (disk only)" if disk_only else ""))


@app.command()
def resume(sandbox_id: str) -> None:
    """Continue a paused sandbox with every process where it was."""
    with errors_reported():
        sbx = Sandbox.resume(sandbox_id)
        sbx.close()
        out.print(f"resumed {sbx.id}")


@app.command()
def checkpoint(
    sandbox_id: str,
    name: Annotated[
        str | None, typer.Option("--name", help="Its name (rollback takes it, or the id).")
    ] = None,
) -> None:
    """Save the running machine; `cryobox rollback` returns to it. Prints the checkpoint id."""
    with errors_reported():
        out.print(Sandbox.connect(sandbox_id).checkpoint(name).id)


@app.command()
def rollback(sandbox_id: str, checkpoint_ref: str) -> None:
    """Return a running sandbox to a checkpoint (id or name)."""
    with errors_reported():
        sbx = Sandbox.connect(sandbox_id)
        sbx.rollback(checkpoint_ref)
        out.print(f"rolled {sbx.id} back to {checkpoint_ref}")


@app.command()
def history(sandbox_id: str, as_json: JsonOption = False) -> None:
    """List the checkpoints a sandbox can rewind to, oldest first (automatic ones too)."""
    with errors_reported():
        points = Sandbox.connect(sandbox_id, resume=False).history()
        if as_json:
            print(json.dumps([dataclasses.asdict(s) for s in points], indent=2))
            return
        now = time.time()
        rows = [
            (
                point.id,
                taken(point.created_at),
                f"{now - point.created_at:.0f}s",
                "automatic" if point.automatic else (point.name or "-"),
            )
            for point in points
        ]
        print_rows(("ID", "TAKEN", "AGO", "NAME"), rows)


@app.command()
def rewind(
    sandbox_id: str,
    to: Annotated[
        str,
        typer.Argument(
            help="How far: seconds ago ('90', '90s', '5m', '2h'), an ISO date and time "
            "(to the end of its last unit: a time as `cryobox history` lists it names "
            "that checkpoint), or a checkpoint's id or name (one named like a duration: "
            "by its id). The newest checkpoint at or before it is used."
        ),
    ],
) -> None:
    """Return a sandbox to a point of its history (files, processes, memory as then)."""
    with errors_reported():
        sbx = Sandbox.connect(sandbox_id)
        point = sbx.rewind(when(to))
        ago = time.time() - point.created_at
        out.print(f"rewound {sbx.id} to {point.id}, taken {ago:.0f} s ago")


_AGO = re.compile(r"(\d+(?:\.\d*)?)([smh]?)")


def taken(created_at: float) -> str:
    """A checkpoint's time as ``history`` lists it: local, to the millisecond, with its
    offset (no hour is ambiguous at a clock change), so that, typed back to ``rewind``
    (:func:`when`), it names that checkpoint."""
    local = datetime.fromtimestamp(created_at).astimezone()
    return local.isoformat(sep=" ", timespec="milliseconds")


def when(text: str) -> str | float | datetime:
    """A rewind's target as typed: a duration ago, an ISO instant, else a checkpoint.

    An instant covers the whole of its last unit: ``23:40:01`` is up to the end of that
    second, ``23:40:01.302`` that millisecond, ``23:40`` that minute, a date alone that
    day. So the time ``history`` lists for a checkpoint names that checkpoint."""
    typed = text.strip()
    if match := _AGO.fullmatch(typed):
        return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]
    try:
        instant = datetime.fromisoformat(typed)
    except ValueError:
        return text
    try:
        return instant + _grain(typed) - timedelta(microseconds=1)
    except OverflowError:  # the last day datetime has: its end is as late as it goes
        return instant


#: An ISO instant's time of day: hours, then minutes, seconds and a fraction if given.
_ISO_CLOCK = re.compile(r"\d{2}(?P<minutes>:?\d{2})?(?P<seconds>:?\d{2})?(?P<fraction>[.,]\d+)?")


def _grain(text: str) -> timedelta:
    """How long the ISO instant ``text`` names: its last unit."""
    clock = _ISO_CLOCK.match(_time_of_day(text))
    if clock is None:
        return timedelta(days=1)  # a date alone
    if clock["fraction"]:
        return timedelta(microseconds=10 ** (6 - min(len(clock["fraction"]) - 1, 6)))
    if clock["seconds"]:
        return timedelta(seconds=1)
    return timedelta(minutes=1) if clock["minutes"] else timedelta(hours=1)


def _time_of_day(text: str) -> str:
    """What follows the date of ISO instant ``text`` and its one separator ('T', ' ',
    't' or any other that ``fromisoformat`` takes); empty for a date alone. (The date's
    length is read from its form: ``date.fromisoformat`` takes "20261207T2" whole.)"""
    if text[4:5] == "-":  # 2026-12-07, 2026-W49-1, 2026-W49
        length = 8 if text[5:6] == "W" and text[8:9] != "-" else 10
    elif text[4:5] == "W":  # 2026W491, 2026W49
        length = 8 if text[7:8].isdigit() else 7
    else:  # 20261207
        length = 8
    return text[length + 1 :]


@snapshot_app.command("take")
def snapshot(
    sandbox_id: str,
    name: str,
    disk_only: Annotated[
        bool, typer.Option("--disk-only", help="Files only: sandboxes started from it boot.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the snapshot of that name.")
    ] = False,
) -> None:
    """Save a sandbox beyond its life; `cryobox create --from-snapshot NAME` starts from it."""
    with errors_reported():
        sbx = Sandbox.connect(sandbox_id)
        out.print(sbx.snapshot(name, memory=not disk_only, overwrite=overwrite).id)


@app.command()
def snapshots(
    delete: Annotated[str | None, typer.Option("--delete", help="Delete this snapshot.")] = None,
    cascade: Annotated[
        bool, typer.Option("--cascade", help="With --delete: the snapshots built on it too.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List saved snapshots, checkpoints and template snapshots (or delete one)."""
    with errors_reported():
        if delete:
            for snapshot_id in Sandbox.delete_snapshot(delete, cascade=cascade):
                out.print(f"deleted {snapshot_id}")
            return
        if as_json:
            print(json.dumps([dataclasses.asdict(s) for s in Sandbox.snapshots()], indent=2))
            return
        now = time.time()
        rows = [
            (
                snap.id,
                snap.name or "-",
                snap.kind,
                snap.purpose,
                snap.source_sandbox,
                snap.parent or "-",
                f"{now - snap.created_at:.0f}s",
                snap.location,
            )
            for snap in Sandbox.snapshots()
        ]
        header = ("ID", "NAME", "KIND", "PURPOSE", "FROM SANDBOX", "PARENT", "AGE", "LOCATION")
        print_rows(header, rows)


@app.command()
def fork(
    sandbox_id: str,
    count: Annotated[int, typer.Option("--count", "-n", help="How many copies (1-100).")] = 1,
) -> None:
    """Fork a running sandbox into N running copies; prints their ids."""
    with errors_reported(), console.status(f"forking {sandbox_id} into {count}"):
        forks = Sandbox.connect(sandbox_id).fork(count)
    for forked in forks:
        out.print(forked.id)


@app.command()
def tree(as_json: JsonOption = False) -> None:
    """Print the lineage of sandboxes and snapshots: which came from which."""
    from rich.tree import Tree

    with errors_reported():
        nodes = Sandbox.lineage()
        if as_json:
            print(json.dumps([node.to_json() for node in nodes], indent=2))
            return
        ids = {node.id for node in nodes}
        children: dict[str | None, list[LineageNode]] = {}
        for node in nodes:
            # A fork's copy whose fork snapshot is gone goes under the sandbox it was
            # forked from, when that is still listed.
            parent = next((p for p in (node.parent, node.forked_from) if p in ids), None)
            children.setdefault(parent, []).append(node)
        root = Tree("[bold]cryobox[/bold] (image)")

        def add(branch: Tree, parent: str | None) -> None:
            for node in children.get(parent, []):
                text = f"{node.id}  {node.kind} {node.state} {node.label}".rstrip()
                if node.parent and node.parent not in ids:
                    forked = node.forked_from in ids
                    text += f"  ({'forked, ' if forked else ''}from {node.parent}, gone)"
                add(branch.add(text), node.id)

        add(root, None)
        out.print(root)


@template_app.command("build")
def template_build(
    name: str,
    context: Annotated[
        Path | None,
        typer.Argument(help="With -f: the folder COPY and ADD take files from (default: .)."),
    ] = None,
    setup: Annotated[
        list[str] | None, typer.Option("--setup", help="Shell command to run (repeatable).")
    ] = None,
    dockerfile: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="Build from this Dockerfile instead of --setup."),
    ] = None,
    build_arg: Annotated[
        list[str] | None,
        typer.Option("--build-arg", help="With -f: NAME=VALUE for an ARG (repeatable)."),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            "--image",
            help="Boot this container image: oci-archive:FILE, docker-archive:FILE or "
            "oci:FOLDER (its ENV, USER, WORKDIR, CMD and ports kept; --setup runs in it).",
        ),
    ] = None,
    cpus: CpusOption = config.DEFAULT_CPUS,
    memory: MemoryOption = config.DEFAULT_MEMORY_MIB,
    disk: DiskOption = config.DEFAULT_DISK_GIB,
) -> None:
    """Boot the image, run the setup commands, save the machine as template NAME; or
    build it from a Dockerfile (-f) with files from CONTEXT, each step cached; or from a
    container image (--image oci-archive:FILE)."""
    with errors_reported(), console.status(f"building template {name}") as status:
        if dockerfile is None and (context is not None or build_arg):
            raise InvalidArgument("CONTEXT and --build-arg go with -f Dockerfile")

        def show(step: str) -> None:
            if (dockerfile or image) is not None and not step.startswith(" "):
                out.print(step)  # a Dockerfile's steps stay on screen, as docker's do
            status.update(f"building template {name}: {step.strip()}")

        snap = Sandbox.build_template(
            name,
            setup or [],
            dockerfile=dockerfile,
            context=(context or Path(".")) if dockerfile is not None else None,
            build_args=key_values("--build-arg", build_arg or []) or None,
            image=image,
            cpus=cpus,
            memory_mib=memory,
            disk_gib=disk,
            progress=show,
        )
    out.print(f"template {name}: snapshot {snap.id}")


@template_app.command("ls")
def template_ls() -> None:
    """List templates (tab-separated when piped)."""
    with errors_reported():
        now = time.time()
        rows = [
            (t.name, t.snapshot_id, str(len(t.setup)), f"{now - t.created_at:.0f}s")
            for t in Sandbox.templates()
        ]
        print_rows(("NAME", "SNAPSHOT", "SETUP STEPS", "AGE"), rows)


@template_app.command("rm")
def template_rm(names: list[str]) -> None:
    """Remove templates and their snapshots (kept while a sandbox builds on one)."""
    with errors_reported():
        for name in names:
            Sandbox.delete_template(name)
            out.print(f"removed template {name}")


@app.command()
def soak(
    minutes: Annotated[float, typer.Option(help="How long to run.")] = 30.0,
    fault_every: Annotated[
        float, typer.Option(help="Seconds between two supervisors killed with -9.")
    ] = 60.0,
    checkpoint_every: Annotated[
        float, typer.Option(help="Seconds between the soaked sandbox's automatic checkpoints.")
    ] = 20.0,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write the report.")] = None,
) -> None:
    """Pause/resume, rollback, fork and rewind cycles on real VMs, a volume mounted,
    beside a server under load whose supervisors are killed; reports cycles, faults and
    anything lost (exit 1)."""
    from cryobox.bench import soak as soaking

    options = ["--minutes", str(minutes), "--fault-every", str(fault_every)]
    options += ["--checkpoint-every", str(checkpoint_every)]
    if json_file is not None:
        options += ["--json", str(json_file)]
    raise typer.Exit(soaking.main(options))


@app.command()
def bench(
    scenarios: Annotated[
        list[str] | None,
        typer.Argument(
            help=f"Scenarios (default: all): {', '.join(SCENARIOS)}.", show_default=False
        ),
    ] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    plot_file: Annotated[Path | None, typer.Option("--plot", help="Draw a PNG chart.")] = None,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Write a BENCHMARKS.md from this run.")
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smoke mode: small counts.")] = False,
) -> None:
    """Measure the headline figures against their baselines on this host."""
    from cryobox.bench import run as benchmarks

    with errors_reported():
        names = tuple(scenarios or SCENARIOS)
        try:
            figures, host = benchmarks.run(names, quick)
            if plot_file is not None:
                benchmarks.plot(figures, plot_file)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        rows = [
            (
                f.scenario,
                f"{f.median} {f.unit}",
                f"{f.p90} {f.unit}",
                f"{f.min} {f.unit}",
                str(f.runs),
                f"{f.ratio} x {f.baseline}" if f.ratio is not None else "-",
                f.note,
            )
            for f in figures
        ]
        print_rows(("SCENARIO", "MEDIAN", "P90", "MIN", "RUNS", "RATIO", "WHAT"), rows)
        out.print(", ".join(f"{k}: {v}" for k, v in host.items()))
        if json_file is not None:
            json_file.write_text(benchmarks.to_json(figures, host) + "\n")
        if markdown is not None:
            kept = benchmarks.kept_section(markdown.read_text()) if markdown.exists() else ""
            markdown.write_text(benchmarks.to_markdown_document(figures, host, quick, kept))


app.command()(server)
app.add_typer(tenant_app, name="tenant")
app.add_typer(host_app, name="host")
app.command()(usage)
app.command()(gc)
app.command()(mcp)

if __name__ == "__main__":
    app()
