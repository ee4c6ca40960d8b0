"""``cryobox soak``: hours of the lifecycle on real VMs, with faults, counting anything lost.

Three workloads share the run:

- **pause/resume**: one sandbox holds a counter (a shell loop writing a number five
  times a second), a 5 MB file and a TCP connection inside the guest (a client that
  sends a ping over one connection every half second and counts the answers). Each
  cycle pauses it, resumes it, and checks that the counter's process is the same and
  its number has not gone back, the file hashes the same, and the connection is the
  same one and still answering.
  The sandbox also mounts a named volume, whose log each probe measures: a volume is
  there, whole, after every resume.
- **checkpoint/rollback and fork**, every few cycles: a checkpoint, the 5 MB file
  removed and a line added to the volume's log, a rollback (the file, the counter and
  the connection are back; the volume's line stays: a rollback does not undo a volume);
  then a fork of two copies, each with the counter running, the file whole, the volume's
  log as the host reads it, and a random number of its own; the copies are killed.
- **rewind**, after each of those: the sandbox keeps a rewindable history (an automatic
  checkpoint every ``checkpoint_every`` seconds, the newest ``keep_checkpoints`` kept).
  A file is written, an automatic checkpoint taken after it is waited for, the file is
  removed and a volume line added, then ``rewind`` to that checkpoint's instant: the
  file is back, the same processes run, the volume's line stays, and no more automatic
  checkpoints are kept than asked.
- **a server under steady API load**: a real ``cryobox server`` with a tenant, a thread
  running a command in its sandbox about five times a second, and, every so often, the
  sandbox's supervisor killed with -9 (a fault). After each fault the sandbox must
  answer again (its supervisor is adopted) with its file whole; requests that fail in
  the fault's wake are counted, not lost.

Anything else that fails is a loss; the run reports cycles, faults and losses (which
must be none). ``make soak`` runs it for 30 minutes; docs/BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryobox import Sandbox, Volume
from cryobox.errors import CryoboxError
from cryobox.sandbox import registry
from cryobox.util import free_port

#: The guest's side of the pause/resume workload.
COUNTER = (
    "i=0; while :; do i=$((i+1)); echo $i > /root/soak-counter.tmp; "
    "mv /root/soak-counter.tmp /root/soak-counter; sleep 0.2; done"
)
TCP_PAIR = r"""
import os, socket, sys, threading, time
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 7707)); server.listen(1)
def serve():
    conn, _ = server.accept()
    while data := conn.recv(64):
        conn.sendall(b"pong\n")
threading.Thread(target=serve, daemon=True).start()
client = socket.create_connection(("127.0.0.1", 7707))
port, count = client.getsockname()[1], 0
while True:
    client.sendall(b"ping\n")
    if client.recv(64) != b"pong\n":
        open("/root/soak-tcp", "w").write(f"broken {port} {count}\n"); sys.exit(1)
    count += 1
    open("/root/soak-tcp.tmp", "w").write(f"ok {port} {count}\n")
    os.replace("/root/soak-tcp.tmp", "/root/soak-tcp")
    time.sleep(0.5)
"""
#: Where the soaked sandbox mounts its volume, and the log the soak appends to there.
VOLUME_AT = "/data"
VOLUME_LOG = "/soak-log"
PROBE = (
    "cat /root/soak-counter-pid /root/soak-counter /root/soak-tcp-pid /root/soak-tcp; "
    "kill -0 $(cat /root/soak-counter-pid) && kill -0 $(cat /root/soak-tcp-pid) && echo alive; "
    "sha256sum /root/soak-blob | cut -c1-64; "
    f"wc -c < {VOLUME_AT}{VOLUME_LOG}"
)
#: The soaked sandbox's history: an automatic checkpoint this often (s), so many kept.
CHECKPOINT_EVERY = 20.0
KEEP_CHECKPOINTS = 4


@dataclass
class SoakReport:
    seconds: float = 0.0
    pause_resume_cycles: int = 0
    rollback_cycles: int = 0
    rewind_cycles: int = 0
    fork_cycles: int = 0
    copies_checked: int = 0
    api_requests: int = 0
    api_failures_after_faults: int = 0
    faults_injected: int = 0
    recoveries: int = 0
    losses: list[str] = field(default_factory=list)
    pause_seconds: list[float] = field(default_factory=list, repr=False)
    resume_seconds: list[float] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.losses and self.pause_resume_cycles > 0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.endswith("_seconds")}
        for name in ("pause_seconds", "resume_seconds"):
            values = sorted(getattr(self, name))
            if values:
                out[f"{name[:-8]}_median_s"] = round(values[len(values) // 2], 3)
                out[f"{name[:-8]}_max_s"] = round(values[-1], 3)
        out["seconds"] = round(self.seconds, 1)
        out["ok"] = self.ok
        return out


@dataclass
class _GuestState:
    counter_pid: str
    counter: int
    tcp_pid: str
    tcp_port: str
    tcp_count: int
    blob: str
    #: The bytes of the volume's log as the guest sees it.
    volume_log: int


def _probe(sbx: Sandbox) -> _GuestState:
    out = sbx.commands.run(PROBE, timeout=60).stdout.split()
    # pid, counter, tcp pid, "ok"/"broken", port, count, "alive", hash, volume log bytes
    if len(out) != 9 or out[3] != "ok" or out[6] != "alive":
        raise AssertionError(f"the guest's workload is not whole: {out}")
    return _GuestState(out[0], int(out[1]), out[2], out[4], int(out[5]), out[7], int(out[8]))


def _start_workload(sbx: Sandbox, volume: Volume) -> _GuestState:
    volume.write_file(VOLUME_LOG, b"started\n")
    blob = os.urandom(5_000_000)
    sbx.files.write("/root/soak-blob", blob)
    sbx.files.write("/root/soak-tcp.py", TCP_PAIR)
    sbx.commands.run(
        f"setsid sh -c '{COUNTER}' >/dev/null 2>&1 </dev/null & echo $! > /root/soak-counter-pid; "
        "setsid python3 /root/soak-tcp.py >/dev/null 2>&1 </dev/null & "
        "echo $! > /root/soak-tcp-pid"
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            state = _probe(sbx)
            break
        except (AssertionError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    if state.blob != hashlib.sha256(blob).hexdigest():
        raise AssertionError("the 5 MB file was not written whole")
    return state


def _same_workload(
    before: _GuestState, after: _GuestState, where: str, volume: Volume
) -> list[str]:
    """What was lost between two probes of the same sandbox (nothing, normally): the
    volume's log is compared with what the host reads of it now."""
    lost = []
    on_host = len(volume.read_file(VOLUME_LOG))
    if after.volume_log != on_host:
        lost.append(
            f"{where}: the guest sees {after.volume_log} bytes of the volume's log, "
            f"the host {on_host}"
        )
    if (after.counter_pid, after.tcp_pid, after.tcp_port) != (
        before.counter_pid,
        before.tcp_pid,
        before.tcp_port,
    ):
        lost.append(f"{where}: a process or the connection changed: {before} -> {after}")
    if after.counter < before.counter or after.tcp_count < before.tcp_count:
        lost.append(f"{where}: a count went back: {before} -> {after}")
    if after.blob != before.blob:
        lost.append(f"{where}: the 5 MB file changed")
    return lost


class _ServerLoad:
    """A real ``cryobox server``, a sandbox of its tenant under steady commands, and
    faults: its supervisor killed with -9."""

    def __init__(self, folder: Path, report: SoakReport) -> None:
        self.report = report
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cli = [sys.executable, "-m", "cryobox.cli.main"]
        database = ["--database", str(folder / "server.db")]
        made = subprocess.run(
            [*cli, "tenant", "create", "soak", *database],
            capture_output=True,
            text=True,
            check=True,
        )
        self.key = made.stdout.strip().splitlines()[-1]
        self.log = open(folder / "server.log", "ab")  # noqa: SIM115 - closed in stop()
        self.server = subprocess.Popen(
            [*cli, "server", "--port", str(self.port), *database],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait_listening(self.port, self.server)
        self.sbx = Sandbox.create(timeout=86400, api_url=self.url, api_key=self.key)
        self.sbx.files.write("/root/soak-mark", "kept")
        self.faulted_at = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._load, daemon=True)
        self._thread.start()

    def _load(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.sbx.commands.run("cat /root/soak-mark", timeout=60).stdout
                with self._lock:
                    self.report.api_requests += 1
                if out != "kept":
                    self.report.losses.append(f"server sandbox: its file reads {out!r}")
            except CryoboxError as exc:
                with self._lock:
                    if time.monotonic() - self.faulted_at < 120:
                        self.report.api_failures_after_faults += 1
                    else:
                        self.report.losses.append(f"server sandbox: {exc}")
                time.sleep(1)
            time.sleep(0.2)

    def fault(self) -> None:
        """Kill the sandbox's supervisor with -9; the load must succeed again within
        120 s (its supervisor adopted), else it is a loss."""
        record = registry.find(self.sbx.id).record()
        if record.supervisor_pid is None:
            return
        with self._lock:
            self.faulted_at = time.monotonic()
            before = self.report.api_requests
        os.kill(record.supervisor_pid, signal.SIGKILL)
        self.report.faults_injected += 1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with self._lock:
                if self.report.api_requests > before + 1:  # one may have been under way
                    self.report.recoveries += 1
                    return
            time.sleep(0.5)
        self.report.losses.append(f"server sandbox {self.sbx.id}: no answer 120 s after a fault")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)
        try:
            self.sbx.kill()
        except CryoboxError as exc:
            self.report.losses.append(f"server sandbox: could not be killed: {exc}")
        self.server.terminate()
        try:
            self.server.wait(30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.log.close()


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"cryobox server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("cryobox server did not listen within 60 s")


def _add_to_volume(sbx: Sandbox, line: str) -> None:
    """A line appended to the volume's log by the guest."""
    sbx.commands.run(f"echo {line} >> {VOLUME_AT}{VOLUME_LOG}", timeout=60)


def _rollback_and_fork(
    sbx: Sandbox, state: _GuestState, report: SoakReport, volume: Volume
) -> _GuestState:
    mark = sbx.checkpoint()
    sbx.commands.run("rm /root/soak-blob")
    _add_to_volume(sbx, f"after-checkpoint-{report.rollback_cycles}")
    sbx.rollback(mark)
    after = _probe(sbx)
    report.losses += _same_workload(state, after, "rollback", volume)
    if after.volume_log <= state.volume_log:
        report.losses.append("rollback: the volume's line written after the checkpoint went")
    report.rollback_cycles += 1
    copies = sbx.fork(2)
    on_host = len(volume.read_file(VOLUME_LOG))  # (nothing writes it while they run)
    try:
        seen = set()
        for copy in copies:
            got = _probe(copy)
            if got.blob != state.blob or got.counter_pid != state.counter_pid:
                report.losses.append(f"fork {copy.id}: its workload is not its parent's")
            if got.volume_log != on_host:
                report.losses.append(f"fork {copy.id}: it does not see the volume's log")
            seen.add(copy.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout)
            report.copies_checked += 1
        if len(seen) != len(copies):
            report.losses.append("fork: two copies drew the same random numbers")
    finally:
        for copy in copies:
            copy.kill()
    report.fork_cycles += 1
    return after


def _rewind(
    sbx: Sandbox,
    state: _GuestState,
    report: SoakReport,
    volume: Volume,
    every: float,
    rewound_to: set[str],
) -> _GuestState:
    """Write a file, wait for an automatic checkpoint taken after it, remove the file and
    add a volume line, rewind to that checkpoint's instant: the file is back, the
    processes the same, the volume's line kept, the history no longer than asked
    (``rewound_to``: the points rewound to so far, this one added)."""
    token = os.urandom(8).hex()
    sbx.commands.run(f"echo {token} > /root/soak-rewind")
    written = time.time()
    deadline = time.monotonic() + 3 * every + 60
    while True:
        after_it = [p for p in sbx.history() if p.automatic and p.created_at > written]
        if after_it:
            point = after_it[0]
            break
        if time.monotonic() > deadline:
            report.losses.append(f"rewind: no automatic checkpoint within {3 * every + 60:g} s")
            return state
        time.sleep(1)
    sbx.commands.run("rm /root/soak-rewind")
    _add_to_volume(sbx, f"after-history-{report.rewind_cycles}")
    went_to = sbx.rewind(to=datetime.fromtimestamp(point.created_at, UTC))
    if went_to.id != point.id:
        report.losses.append(f"rewind: went to {went_to.id}, not {point.id}")
    after = _probe(sbx)
    report.losses += _same_workload(state, after, "rewind", volume)
    back = sbx.commands.run("cat /root/soak-rewind", timeout=60)
    if back.stdout.strip() != token:
        report.losses.append(
            f"rewind: the file written before the checkpoint reads {back.stdout!r}"
        )
    if after.volume_log <= state.volume_log:
        report.losses.append("rewind: the volume's line written after the checkpoint went")
    rewound_to.add(point.id)
    # A point a rewind went back to stays while the sandbox builds on it (each later
    # point does: its disk layer lies over that point's), so only the others count.
    # The oldest goes once the newest is taken and the one before it folded: a look
    # between the two sees one more for a moment.
    deadline = time.monotonic() + every
    while True:
        kept = [p for p in sbx.history() if p.automatic and p.id not in rewound_to]
        if len(kept) <= KEEP_CHECKPOINTS or time.monotonic() > deadline:
            break
        time.sleep(1)
    if len(kept) > KEEP_CHECKPOINTS:
        report.losses.append(
            f"rewind: {len(kept)} automatic checkpoints kept besides those rewound to, "
            f"not {KEEP_CHECKPOINTS}"
        )
    report.rewind_cycles += 1
    return after


def run(
    minutes: float,
    *,
    server_faults_every: float = 60.0,
    fork_every: int = 25,
    checkpoint_every: float = CHECKPOINT_EVERY,
) -> SoakReport:
    """Soak for ``minutes``: pause/resume cycles, a rollback, a fork and a rewind every
    ``fork_every`` cycles (the history's automatic checkpoints ``checkpoint_every``
    seconds apart), a supervisor of the server's sandbox killed about every
    ``server_faults_every`` seconds."""
    report = SoakReport()
    started = time.monotonic()
    end = started + minutes * 60
    folder = Path(tempfile.mkdtemp(prefix="cryobox-soak-"))
    load = _ServerLoad(folder, report)
    volume: Volume | None = None
    sbx: Sandbox | None = None
    rewound_to: set[str] = set()
    try:
        volume = Volume.create(f"soak-{os.getpid()}-{os.urandom(3).hex()}", size_gib=1)
        sbx = Sandbox.create(
            timeout=86400,
            volumes={VOLUME_AT: volume.name},
            checkpoint_every=checkpoint_every,
            keep_checkpoints=KEEP_CHECKPOINTS,
        )
        state = _start_workload(sbx, volume)
        next_fault = time.monotonic() + random.uniform(0.5, 1.5) * server_faults_every
        while time.monotonic() < end:
            began = time.monotonic()
            sbx.pause()
            paused = time.monotonic()
            sbx = Sandbox.connect(sbx.id)  # resumes it
            report.pause_seconds.append(paused - began)
            report.resume_seconds.append(time.monotonic() - paused)
            after = _probe(sbx)
            where = f"cycle {report.pause_resume_cycles}"
            report.losses += _same_workload(state, after, where, volume)
            state = after
            report.pause_resume_cycles += 1
            if report.pause_resume_cycles % fork_every == 0:
                state = _rollback_and_fork(sbx, state, report, volume)
                state = _rewind(sbx, state, report, volume, checkpoint_every, rewound_to)
            if time.monotonic() >= next_fault:
                load.fault()
                next_fault = time.monotonic() + random.uniform(0.5, 1.5) * server_faults_every
            if report.losses:
                break  # a loss ends the run: its state is what to look at
    finally:
        report.seconds = time.monotonic() - started
        try:
            if sbx is not None:
                sbx.kill()
            if volume is not None:
                Volume.delete(volume.name)
        finally:
            load.stop()
            if not report.losses:  # (after a loss, its server's log is what to look at)
                shutil.rmtree(folder, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="cryobox soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds")
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=CHECKPOINT_EVERY,
        help="seconds between the soaked sandbox's automatic checkpoints",
    )
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    report = run(
        args.minutes,
        server_faults_every=args.fault_every,
        checkpoint_every=args.checkpoint_every,
    )
    text = json.dumps(report.summary(), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
