"""``cryobox bench``: the headline figures, each beside its baseline measured in the same run.

Baselines: the cold boot (for start, resume and fork times), this disk's write
bandwidth with fsync (for pause and snapshot, whose floor is writing dirty pages),
guest RAM (for memory use). Figures are median, p90 and minimum over repeated runs.
Nothing here passes or fails on timing; ``--quick`` is a smoke run of every scenario
with small counts (what CI runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.client import AsyncSandbox
from cryobox.client.transport import default_transport
from cryobox.qemu import qemu_version
from cryobox.service import pool, pool_refill
from cryobox.util import host_memory_mib

from . import SCENARIOS
from . import bounds as bench_bounds
from . import cli_start as bench_cli
from . import diy as bench_diy
from . import http as bench_http
from . import saved as bench_saved
from . import shapes as bench_shapes
from . import steps as bench_steps
from . import store as bench_store
from . import translation as bench_translation
from . import volumes as bench_volumes
from .store import disk_bandwidth_mb_s, environment

#: Timed inside the guest: a plain spawn of ``true``, and one started as the agent starts
#: a command (a session of its own, stdout and stderr through pipes, read to their end).
GUEST_SPAWN = """
import subprocess, time
plain, captured = [], []
for _ in range({n}):
    start = time.perf_counter()
    subprocess.run(["true"])
    plain.append(time.perf_counter() - start)
    start = time.perf_counter()
    subprocess.Popen(
        ["true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    ).communicate()
    captured.append(time.perf_counter() - start)
print(" ".join(f"{{s:.6f}}" for s in plain))
print(" ".join(f"{{s:.6f}}" for s in captured))
"""


#: The Python program given as ``$1`` run with the guest's address randomization on,
#: then the setting put back as it was (a process's layout is chosen when it starts).
RANDOMIZED = """
setting=/proc/sys/kernel/randomize_va_space
was=$(cat $setting)
echo 2 > $setting
python3 -c "$1"
status=$?
echo $was > $setting
exit $status
"""


#: The guest's own agent code served over a socket pair inside the guest, with no host,
#: QEMU or virtio on the way: what the agent's Python alone costs a request under TCG.
#: One line of ping times, one of exec (``true``) times.
AGENT_IN_GUEST = """
import asyncio, os, socket, subprocess, sys, time
sys.path.insert(0, "/run/cryobox/lib")
from cryobox.guest import agent, protocol

FRONT = "/run/cryobox/cryobox-agent"

async def main():
    ours, theirs = socket.socketpair()
    front = None
    if os.path.exists(FRONT):  # as the port is served: the front, Python behind it
        env = dict(
            os.environ, CRYOBOX_AGENT_PORT_FD=str(theirs.fileno()), PYTHONPATH="/run/cryobox/lib"
        )
        front = subprocess.Popen(
            [FRONT, sys.executable, "-m", "cryobox.guest.agent", "--fd", "3"],
            env=env, pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL,
        )
    else:
        served = agent.Agent()
        served.channel = agent.Channel(
            os.dup(theirs.fileno()), asyncio.get_running_loop(), served.on_frame
        )
    theirs.close()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    decoder, ids = protocol.Decoder(), iter(range(1, 10**6))

    async def call(op, args):
        rid = next(ids)
        writer.write(protocol.encode({{"id": rid, "op": op, "args": args}}))
        while True:
            for item in decoder.feed(await asyncio.wait_for(reader.read(65536), 60)):
                header = getattr(item, "header", {{}})
                if item.id == rid and ("ok" in header or "error" in header):
                    return

    await call("ping", {{}})
    for op, args in (("ping", {{}}), ("exec", {{"argv": ["true"]}})):
        samples = []
        for _ in range({n}):
            start = time.perf_counter()
            await call(op, args)
            samples.append(time.perf_counter() - start)
        print(" ".join(f"{{s:.6f}}" for s in samples))
    if front is not None:
        front.kill()  # its Python part dies with it
        front.wait()

asyncio.run(main())
"""


@dataclass(frozen=True)
class Figure:
    scenario: str
    unit: str
    runs: int
    median: float
    p90: float
    min: float
    baseline: str = ""
    ratio: float | None = None
    note: str = ""
    #: The same figure for plain QEMU driven by hand (:mod:`.diy`), this run.
    diy: float | None = None
    diy_ratio: float | None = None


@dataclass
class Context:
    quick: bool
    cold_boot_s: float | None = None
    disk_mb_s: float | None = None
    made_templates: list[str] = field(default_factory=list)
    diy: bench_diy.DiyFigures | None = None
    #: A warm pool member's identity refresh at claim (ms): its QEMU translated the
    #: guest's code already (template-start measures it).
    warm_refresh_ms: float | None = None


def summarize(
    scenario: str,
    samples: list[float],
    unit: str,
    *,
    scale: float = 1.0,
    baseline: str = "",
    base_value: float | None = None,
    note: str = "",
) -> Figure:
    ordered = sorted(s * scale for s in samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    median = statistics.median(ordered)
    ratio = round(median / base_value, 3) if base_value else None
    return Figure(
        scenario,
        unit,
        len(ordered),
        round(median, 3),
        round(p90, 3),
        round(ordered[0], 3),
        baseline,
        ratio,
        note,
    )


async def _timed(call: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


async def _ready(sbx: AsyncSandbox) -> AsyncSandbox:
    await sbx.commands.run(["true"])
    return sbx


# --------------------------------------------------------------------------- scenarios


async def cold_boot(ctx: Context) -> list[Figure]:
    samples = []
    for _ in range(1 if ctx.quick else 3):
        start = time.perf_counter()
        sbx = await _ready(await AsyncSandbox.create("base"))
        samples.append(time.perf_counter() - start)
        await sbx.kill()
    ctx.cold_boot_s = statistics.median(samples)
    return [summarize("cold-boot", samples, "s", note="create('base') to first command")]


async def exec_and_channel(ctx: Context, names: tuple[str, ...]) -> list[Figure]:
    """The exec round trip beside what it is made of, interleaved in rounds so that the
    machine's drift hits each alike: the agent's no-op (the channel's round trip), and
    the guest's own spawn of ``true``, plain and with its output captured."""
    rounds = 1 if ctx.quick else 5
    per_round = 10 if ctx.quick else 20
    execs: list[float] = []
    pings: list[float] = []
    plain: list[float] = []
    captured: list[float] = []
    randomized: list[float] = []
    local_pings: list[float] = []
    local_execs: list[float] = []
    ping_cpu = {"this process": 0.0, "supervisor": 0.0, "QEMU": 0.0}
    transport = default_transport()
    sbx = await _ready(await AsyncSandbox.create())
    try:
        info = await sbx.info()
        for _ in range(rounds):
            execs += await _timed(lambda: sbx.commands.run(["true"]), per_round)
            before = _cpu_now(info.supervisor_pid, info.vmm_pid)
            pings += await _timed(lambda: transport.ping(sbx.id), per_round)
            after = _cpu_now(info.supervisor_pid, info.vmm_pid)
            for name, started, ended in zip(ping_cpu, before, after, strict=True):
                ping_cpu[name] += ended - started
            program = GUEST_SPAWN.format(n=per_round // 2)
            lines = (await sbx.commands.run(["python3", "-c", program])).stdout.splitlines()
            plain += [float(word) for word in lines[0].split()]
            captured += [float(word) for word in lines[1].split()]
            # The same with the guest's address randomization on (config.guest_aslr).
            ran = await sbx.commands.run(["sh", "-c", RANDOMIZED, "sh", program])
            if ran.exit_code != 0:
                raise RuntimeError(f"the randomized guest spawn failed: {ran.stderr[-500:]}")
            randomized += [float(word) for word in ran.stdout.splitlines()[0].split()]
            program = AGENT_IN_GUEST.format(n=per_round // 2)
            lines = (await sbx.commands.run(["python3", "-c", program])).stdout.splitlines()
            local_pings += [float(word) for word in lines[0].split()]
            local_execs += [float(word) for word in lines[1].split()]
    finally:
        await sbx.kill()
    exec_ms, ping_ms = statistics.median(execs) * 1000, statistics.median(pings) * 1000
    plain_ms, captured_ms = statistics.median(plain) * 1000, statistics.median(captured) * 1000
    local_ping_ms = statistics.median(local_pings) * 1000
    local_exec_ms = statistics.median(local_execs) * 1000
    per_ping = ", ".join(f"{name} {cpu / len(pings) * 1000:.1f}" for name, cpu in ping_cpu.items())
    figures = [
        summarize("exec", execs, "ms", scale=1000, note="`true` via SDK, supervisor, agent"),
        summarize(
            "ping",
            pings,
            "ms",
            scale=1000,
            note=f"agent no-op via supervisor; CPU per ping (ms): {per_ping}",
        ),
        summarize(
            "guest-spawn",
            plain,
            "ms",
            scale=1000,
            note="subprocess.run(['true']) timed inside the guest",
        ),
        summarize(
            "guest-spawn-captured",
            captured,
            "ms",
            scale=1000,
            baseline="guest-spawn",
            base_value=plain_ms,
            note="the same in a session of its own, stdout and stderr through pipes read "
            "to their end, as the agent starts a command (it does so in C: clone, exec)",
        ),
        summarize(
            "guest-spawn-aslr",
            randomized,
            "ms",
            scale=1000,
            baseline="guest-spawn",
            base_value=plain_ms,
            note="the same with the guest's address randomization on (CRYOBOX_GUEST_ASLR=on; "
            "off by default under TCG): each process's libraries at new addresses, "
            "translated again",
        ),
        summarize(
            "agent-in-guest-ping",
            local_pings,
            "ms",
            scale=1000,
            baseline="ping",
            base_value=ping_ms,
            note="the agent's no-op served inside the guest over a socket pair (by a second "
            "front, the agent's compiled part, as the port is), asked by a client in the "
            "guest (Python): no host, QEMU or virtio on the way",
        ),
        summarize(
            "agent-in-guest-exec",
            local_execs,
            "ms",
            scale=1000,
            baseline="exec",
            base_value=exec_ms,
            note=f"`true` the same way: {local_exec_ms - plain_ms:.1f} ms over guest-spawn, "
            f"of which the in-guest client's side of a round trip is at most "
            f"{local_ping_ms:.1f} (agent-in-guest-ping)",
        ),
        summarize(
            "exec-overhead",
            [exec_ms - plain_ms],
            "ms",
            baseline="the speed issue's goal, 5 ms",
            base_value=5.0,
            note=f"exec minus guest-spawn (medians): the "
            f"channel's round trip (ping) {ping_ms:.1f}, capturing the output "
            f"{captured_ms - plain_ms:.1f} (as Python's subprocess does it), the rest "
            f"{exec_ms - captured_ms - ping_ms:.1f}"
            + (
                " (below zero: the agent's compiled front starts and reads a command for "
                "less than Python's subprocess.run, the floor measured)"
                if exec_ms < captured_ms + ping_ms
                else ""
            ),
        ),
    ]
    wanted = set(names)
    if "guest-spawn" in wanted:
        wanted |= {"guest-spawn-captured", "guest-spawn-aslr"}
        wanted |= {"agent-in-guest-ping", "agent-in-guest-exec"}
        wanted |= {"exec-overhead"}
    return [figure for figure in figures if figure.scenario in wanted]


def _cpu_now(*pids: int | None) -> list[float]:
    """CPU seconds used so far by this process, then by each of ``pids``."""
    return [time.process_time(), *(bench_steps.cpu_seconds(pid) for pid in pids)]


async def template_start(ctx: Context) -> list[Figure]:
    """create() to first command: claimed from the warm pool, and restored (pool off)."""
    await (await AsyncSandbox.create()).kill()  # the default template exists, spare is warm
    runs = 2 if ctx.quick else 5
    restored = []
    for _ in range(runs):
        start = time.perf_counter()
        sbx = await _ready(await AsyncSandbox.create())
        restored.append(time.perf_counter() - start)
        await sbx.kill()
    pooled: list[float] = []
    warm: list[float] = []
    with warm_pool(1):
        for _ in range(runs):
            await asyncio.to_thread(_wait_pool_ready)
            start = time.perf_counter()
            sbx = await _ready(await AsyncSandbox.create())
            pooled.append(time.perf_counter() - start)
            assert (await sbx.info()).pooled, "the bench's create was not served by the pool"
            claim = bench_steps.step_timings(sbx.id, "claim")
            if claim and "identity" in claim:
                warm.append(claim["identity"])
            await sbx.kill()
    if warm:
        ctx.warm_refresh_ms = statistics.median(warm)
    return [
        summarize(
            "template-start",
            pooled,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="create() from the default template to first command: claimed from its warm "
            "pool (1 waiting, refilled between runs)",
        ),
        summarize(
            "template-restore",
            restored,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="the same with the pool off: a memory-snapshot restore",
        ),
    ]


@contextlib.contextmanager
def warm_pool(size: int) -> Iterator[None]:
    """The default template's pool at ``size`` for the block (off elsewhere in the bench:
    a refill would compete with every other figure for the cores); ended after, and
    before: a member left from another session (another environment) is not claimed."""
    pool_refill.end_members()
    os.environ["CRYOBOX_POOL_SIZE"] = str(size)
    try:
        yield
    finally:
        os.environ["CRYOBOX_POOL_SIZE"] = "0"
        pool_refill.end_members()


def _wait_pool_ready(timeout: float = 120.0) -> None:
    pool.request_refill()
    deadline = time.monotonic() + timeout
    while not pool.members("default"):
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool was not refilled within 120 s")
        time.sleep(0.05)
    time.sleep(1.0)  # the refill process exits; its Python start no longer competes


@dataclass
class _Resumes:
    """One kind of resume's timings, a list entry per run."""

    total: list[float] = field(default_factory=list)  # resume() to first command
    calls: list[float] = field(default_factory=list)  # resume() itself
    first_exec: list[float] = field(default_factory=list)
    second_exec: list[float] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)

    def step(self, name: str) -> float:
        """The supervisor step's median, ms."""
        return statistics.median([s.get(name, 0.0) for s in self.steps]) if self.steps else 0.0

    def outside(self) -> float:
        """Median ms of resume() outside the supervisor's steps."""
        pairs = zip(self.calls, self.steps, strict=True)
        around = [1000 * call - steps.get("total", 0.0) for call, steps in pairs]
        return statistics.median(around) if around else 0.0


async def _resume_timed(sandbox_id: str, into: _Resumes, steps: str) -> AsyncSandbox:
    start = time.perf_counter()
    sbx = await AsyncSandbox.resume(sandbox_id)
    returned = time.perf_counter()
    into.calls.append(returned - start)
    await sbx.commands.run(["true"])
    into.total.append(time.perf_counter() - start)
    into.first_exec.append(time.perf_counter() - returned)
    start = time.perf_counter()
    await sbx.commands.run(["true"])
    into.second_exec.append(time.perf_counter() - start)
    into.steps.append(bench_steps.step_timings(sandbox_id, steps) or {})
    return sbx


async def pause_resume(ctx: Context, names: tuple[str, ...]) -> list[Figure]:
    runs = 2 if ctx.quick else 4
    dirty_mb = 32 if ctx.quick else 256
    changed_mb = 16 if ctx.quick else 100
    pauses, expected, after_change = [], [], []
    held, released = _Resumes(), _Resumes()
    sbx = await _ready(await AsyncSandbox.create())
    try:
        # RAM the guest really uses: a process that keeps dirty_mb of data in memory.
        await sbx.commands.run(
            ["python3", "-c", f"import os,time; b=os.urandom({dirty_mb}<<20); time.sleep(10**6)"],
            background=True,
        )
        await asyncio.sleep(3 if ctx.quick else 8)
        for run in range(runs):
            if run:  # the guest rewrites changed_mb of its RAM between pauses
                await sbx.commands.run(
                    f"head -c {changed_mb}M /dev/urandom > /dev/shm/changed-{run}"
                )
            used_mb = (await sbx.info()).ram_file_bytes / 1e6
            # A pause whose VM ends at once, and a resume that starts a new QEMU...
            with environment({"CRYOBOX_PAUSE_HOLD": "0"}):
                start = time.perf_counter()
                await sbx.pause()
                pauses.append(time.perf_counter() - start)
            if run:
                after_change.append(pauses[-1])
            expected.append(used_mb / (ctx.disk_mb_s or 400))
            sbx = await _resume_timed(sbx.id, released, "resume")
            # ...then one that keeps it for the default hold, woken within it.
            with environment({"CRYOBOX_PAUSE_HOLD": str(config.PAUSE_HOLD)}):
                await sbx.pause()
            sbx = await _resume_timed(sbx.id, held, "wake")
    finally:
        await sbx.kill()
    figures = []
    if "pause" in names:
        over = [p - e for p, e in zip(pauses, expected, strict=True)]
        figures.append(
            summarize(
                "pause",
                pauses,
                "s",
                baseline="RAM used / disk bandwidth",
                base_value=statistics.median(expected),
                note=f"1 GiB guest holding {dirty_mb} MB; beyond writing its "
                f"used RAM: {statistics.median(over):.2f} s",
            )
        )
        figures.append(
            summarize(
                "pause-after-change",
                after_change,
                "s",
                baseline="0.5 s + MB changed / disk bandwidth",
                base_value=0.5 + changed_mb * 1.048576 / (ctx.disk_mb_s or 400),
                note=f"1 GiB guest, {changed_mb} MiB of its RAM rewritten since the "
                "last resume (the store issue's goal: ratio <= 1)",
            )
        )
    if "resume" in names:
        figures.append(
            summarize(
                "resume",
                held.total,
                "s",
                baseline="cold boot",
                base_value=ctx.cold_boot_s,
                note=f"resume() to first command, within the pause's hold (CRYOBOX_PAUSE_HOLD, "
                f"default {config.PAUSE_HOLD:g} s: its QEMU kept, stopped). Median ms: the "
                f"wake in the supervisor {held.step('total'):.0f} (files back "
                f"{held.step('files back'):.0f}, guest's first answer (clock, entropy) "
                f"{held.step('agent refreshed'):.0f}), around it in resume() "
                f"{held.outside():.0f}; then the first command "
                f"{1000 * statistics.median(held.first_exec):.0f}, the second "
                f"{1000 * statistics.median(held.second_exec):.0f}",
            )
        )
        figures.append(
            summarize(
                "resume-released",
                released.total,
                "s",
                baseline="cold boot",
                base_value=ctx.cold_boot_s,
                note="resume() to first command, once the hold is over (CRYOBOX_PAUSE_HOLD=0 "
                "for these pauses): a new QEMU loads the saved pause",
            )
        )
        warm = f"{ctx.warm_refresh_ms:.0f} ms" if ctx.warm_refresh_ms else "not measured"
        figures.append(
            summarize(
                "resume-steps",
                [s.get("total", 0.0) / 1000 for s in released.steps],
                "s",
                note=f"resume-released in the supervisor (median ms): the pause checked "
                f"{released.step('checked'):.0f} and its files put back "
                f"{released.step('files back'):.0f}, QEMU started {released.step('vm start'):.0f}, "
                f"device state {released.step('device state'):.0f}, guest's first answer (clock, "
                f"entropy, identity) {released.step('agent refreshed'):.0f}, of which the "
                f"agent's own part (request read to answer) "
                f"{released.step('of which in the agent'):.0f}; the same refresh by a warm "
                f"pool member's QEMU: {warm}. Outside these steps, in resume() "
                f"{released.outside():.0f} ms (the service; a supervisor forked, waiting for "
                "the one that paused to exit, set up; the pause folder removed; the reply). "
                "Then the first command "
                f"{1000 * statistics.median(released.first_exec):.0f} ms, the second "
                f"{1000 * statistics.median(released.second_exec):.0f} ms: a new QEMU translates "
                "(TCG) every guest instruction it runs for the first time",
            )
        )
    return figures


async def checkpoint_rollback(ctx: Context) -> list[Figure]:
    runs = 2 if ctx.quick else 5
    checkpoints, rollbacks = [], []
    sbx = await _ready(await AsyncSandbox.create())
    try:
        for i in range(runs):
            await sbx.files.write(f"/root/file-{i}", os.urandom(1 << 20))
            start = time.perf_counter()
            saved = await sbx.checkpoint()
            checkpoints.append(time.perf_counter() - start)
            start = time.perf_counter()
            await sbx.rollback(saved)
            await sbx.commands.run(["true"])
            rollbacks.append(time.perf_counter() - start)
    finally:
        await sbx.kill()
    return [
        summarize(
            "checkpoint",
            checkpoints,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="the sandbox keeps running",
        ),
        summarize(
            "rollback",
            rollbacks,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="to first command after",
        ),
    ]


#: The steps of a fork the translation scenario follows: its first answer, then two `true`.
_STEPS: tuple[list[str] | None, ...] = (None, ["true"], ["true"])


async def translation(ctx: Context) -> list[Figure]:
    """Which guest code a fork's new QEMU translates (:mod:`.translation`): on the
    way to its first answer (restore and identity refresh), for its first ``true``, for
    its second; and, in a second fork that logs nothing, the CPU its QEMU spends on each.
    Only where this process starts the VMs, under TCG."""
    if getattr(default_transport(), "api_url", None):
        return []  # a server's VMs: their QEMU log would be on its host
    parent = await _ready(await AsyncSandbox.create())
    folder = Path(tempfile.mkdtemp(prefix="cbx-tcg-"))
    try:
        if (await parent.info()).accelerator == "kvm":
            return []
        logged = await _translating_fork(parent, folder / "in_asm.log")
        cpu = await _fork_cpu(parent)
        with (folder / "in_asm.log").open("rb") as log:
            phases = bench_translation.attribute(log, *logged.marks_and_maps())
    finally:
        await parent.kill()
        shutil.rmtree(folder, ignore_errors=True)
    spent = [cpu[0], cpu[1] - cpu[0], cpu[2] - cpu[1]]
    names = ("fork-translated", "fork-translated-first-true", "fork-translated-second-true")
    whats = (
        "guest code a fork's new QEMU translated (TCG) until its first answer (restore, "
        "identity refresh)",
        "then for its first `true`",
        "then for its second",
    )
    randomized = (
        ""
        if logged.randomization == "0"
        else (
            f" (the guest randomizes address spaces ({logged.randomization}): a command's "
            "libraries count as its own code)"
        )
    )
    ends = (
        f". Host code TCG made for all three and two more commands: {logged.host_mib:.1f} "
        f"MiB{randomized}",
        "",
        "",
    )
    return [
        summarize(
            name,
            [phase.total_kib()],
            "KiB",
            note=f"{what}: {phase.describe()}; QEMU CPU of a fork logging nothing: "
            f"{ms:.0f} ms{end}",
        )
        for name, what, phase, ms, end in zip(names, whats, phases[:3], spent, ends, strict=True)
    ]


@dataclass
class _LoggedFork:
    marks: list[int]  # the log's size after each of _STEPS
    agent_maps: str
    command_maps: str
    kallsyms: str  # the guest kernel's symbols, to name the functions it translated
    randomization: str  # the guest's kernel.randomize_va_space
    host_mib: float  # TCG's translated code in the QEMU at the end

    def marks_and_maps(self) -> tuple[list[int], str, str, str]:
        return self.marks, self.agent_maps, self.command_maps, self.kallsyms


async def _translating_fork(parent: AsyncSandbox, log: Path) -> _LoggedFork:
    """Fork ``parent`` once with QEMU logging each block it translates into ``log``."""
    with environment({"CRYOBOX_TCG_LOG": str(log)}):
        (copy,) = await parent.fork(1)
    try:
        marks = []
        for step in _STEPS:
            if step:
                await copy.commands.run(step)
            await asyncio.sleep(0.3)  # what the guest does right after its answer
            marks.append(log.stat().st_size)
        agent = await copy.commands.run(["sh", "-c", "cat /proc/$PPID/maps"])
        command = await copy.commands.run(["cat", "/proc/self/maps"])
        setting = await copy.commands.run(["cat", "/proc/sys/kernel/randomize_va_space"])
        qemu = (await copy.info()).vmm_pid or 0
        host_mib = bench_steps.memory_parts([qemu])[bench_steps.TRANSLATED_CODE]
    finally:
        await copy.kill()
    # The parent's symbols: the fork's kernel is the same memory, and reading them there
    # would add to what this QEMU translates.
    kallsyms = await parent.commands.run(["cat", "/proc/kallsyms"], user="root")
    return _LoggedFork(
        marks, agent.stdout, command.stdout, kallsyms.stdout, setting.stdout.strip(), host_mib
    )


async def _fork_cpu(parent: AsyncSandbox) -> list[float]:
    """QEMU's CPU (ms) in a fork of ``parent`` after each of _STEPS."""
    (copy,) = await parent.fork(1)
    try:
        qemu = (await copy.info()).vmm_pid
        spent = []
        for step in _STEPS:
            if step:
                await copy.commands.run(step)
            await asyncio.sleep(0.3)  # as the logged fork's steps
            spent.append(bench_steps.cpu_seconds(qemu) * 1000)
    finally:
        await copy.kill()
    return spent


#: Runs of each of fork-10 and fork-10-multi, interleaved (the goal's figure: one run
#: alone moved by 0.3 s between two bench runs of one morning).
FORK_10_RUNS = 3


@dataclass
class _ForkRun:
    """One fork of ``count`` copies, measured until each copy answered a command."""

    elapsed: float
    qemu_cpu: float  # summed over the copies
    supervisor_cpu: float
    parts: dict[str, float]  # PSS of the copies' QEMUs by part (bench_steps.memory_parts)
    supervisors_mib: float
    supervisors: int  # processes (the copies of a fork share them)


async def fork(ctx: Context) -> list[Figure]:
    """Forks of 1, 10 (as the product starts them, and multi-threaded TCG, interleaved)
    and 100 copies."""
    plan: list[int | str] = [1, 3] if ctx.quick else [1, *["10", "10-multi"] * FORK_10_RUNS, 100]
    runs: dict[str, list[_ForkRun]] = {}
    for label in plan:
        count = int(str(label).split("-")[0])
        # Fork 10 again with a host thread per vCPU: 10 copies on fewer cores start with
        # their vCPUs on one (config.fork_tcg_threads) unless the host says otherwise.
        multi = str(label).endswith("multi")
        with environment({"CRYOBOX_TCG_THREADS": "multi"} if multi else {}):
            runs.setdefault(str(label), []).append(await _fork_once(ctx, count))
    figures = []
    for label, measured in runs.items():
        figures += _fork_figures(ctx, label, int(label.split("-")[0]), measured)
    return figures


def _fork_memory(count: int) -> int:
    return 256 if count == 100 else config.DEFAULT_MEMORY_MIB


async def _fork_once(ctx: Context, count: int) -> _ForkRun:
    """Fork ``count`` copies at once of a fresh parent; time, CPU and memory."""
    memory = _fork_memory(count)
    template = "default"
    if memory != config.DEFAULT_MEMORY_MIB:
        template = "bench-256"
        if template not in ctx.made_templates:
            await AsyncSandbox.build_template(template, memory_mib=memory)
            ctx.made_templates.append(template)
    parent = await _ready(await AsyncSandbox.create(template))
    forks: list[AsyncSandbox] = []
    try:
        start = time.perf_counter()
        forks = await parent.fork(count)
        await asyncio.gather(*(f.commands.run(["true"]) for f in forks))
        elapsed = time.perf_counter() - start
        infos = [await f.info() for f in forks]  # new processes: their CPU is the fork's
        qemus = [i.vmm_pid for i in infos]
        # Each counted once: the copies of a fork share supervisor processes.
        supervisor_pids = list(dict.fromkeys(i.supervisor_pid for i in infos))
        return _ForkRun(
            elapsed,
            sum(map(bench_steps.cpu_seconds, qemus)),
            sum(map(bench_steps.cpu_seconds, supervisor_pids)),
            bench_steps.memory_parts([pid for pid in qemus if pid]),
            host_memory_mib(tuple(supervisor_pids)) or 0.0,
            len(supervisor_pids),
        )
    finally:
        for sbx in forks:
            await sbx.kill()
        await parent.kill()


def _fork_figures(ctx: Context, label: str, count: int, runs: list[_ForkRun]) -> list[Figure]:
    """``fork-{label}``: time, CPU and memory over ``runs``; notes give their medians."""
    memory = _fork_memory(count)
    cores = os.cpu_count() or 1
    elapsed = [r.elapsed for r in runs]
    cpu = [r.qemu_cpu + r.supervisor_cpu for r in runs]
    pss = [sum(r.parts.values()) for r in runs]  # proportional: shared pages counted once
    supervisors = statistics.median(r.supervisors_mib for r in runs)
    qemu_cpu = statistics.median(r.qemu_cpu for r in runs)
    supervisor_cpu = statistics.median(r.supervisor_cpu for r in runs)
    parts = {name: statistics.median(r.parts[name] for r in runs) for name in runs[0].parts}
    runs_said = f" (median of {len(runs)} runs)" if len(runs) > 1 else ""
    return [
        summarize(
            f"fork-{label}",
            elapsed,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note=f"all {count} exec-ready; {statistics.median(elapsed) / count:.2f} s per fork"
            + ("; its runs interleaved with the other TCG threading's" if len(runs) > 1 else ""),
        ),
        summarize(
            f"fork-{label}-cpu",
            cpu,
            "s",
            baseline=f"wall time x {cores} cores",
            base_value=statistics.median(elapsed) * cores,
            note=f"CPU the {count} forks' processes used until all answered{runs_said}: QEMU "
            f"{qemu_cpu / count:.2f} s and supervisor {supervisor_cpu / count:.3f} s per "
            f"fork. Spread over {cores} cores it alone takes "
            f"{statistics.median(cpu) / cores:.1f} s",
        ),
        summarize(
            f"fork-{label}-pss",
            pss,
            "MiB",
            baseline=f"{count} x guest RAM",
            base_value=count * memory,
            note=f"sum of PSS of {count} QEMUs, {memory} MiB guests; per fork{runs_said}: "
            + ", ".join(f"{name} {mib / count:.1f}" for name, mib in parts.items())
            + " MiB",
        ),
        summarize(
            f"fork-{label}-all-pss",
            [p + r.supervisors_mib for p, r in zip(pss, runs, strict=True)],
            "MiB",
            baseline=f"{count} x guest RAM",
            base_value=count * memory,
            note=f"the same with their supervisors ({supervisors / count:.1f} MiB per fork, "
            f"{statistics.median(r.supervisors for r in runs):g} processes serving the "
            f"{count}): every host process a fork needs",
        ),
    ]


async def restore_vs_ram(ctx: Context) -> list[Figure]:
    figures = []
    sizes = (512, 4096)
    medians = {}
    for memory in sizes:
        template = f"bench-{memory}"
        if template not in ctx.made_templates:
            await AsyncSandbox.build_template(template, memory_mib=memory)
            ctx.made_templates.append(template)
        samples = []
        for _ in range(1 if ctx.quick else 3):
            start = time.perf_counter()
            sbx = await _ready(await AsyncSandbox.create(template))
            samples.append(time.perf_counter() - start)
            await sbx.kill()
        medians[memory] = statistics.median(samples)
        figures.append(
            summarize(
                f"restore-{memory}MiB",
                samples,
                "s",
                baseline="restore 512 MiB" if memory != sizes[0] else "",
                base_value=medians[sizes[0]] if memory != sizes[0] else None,
                note="template start to first command",
            )
        )
    return figures


async def snapshot_bytes(ctx: Context) -> list[Figure]:
    figures = []
    sbx = await _ready(await AsyncSandbox.create())
    try:
        for changed_mb in (8,) if ctx.quick else (8, 64, 256):
            await sbx.commands.run(f"head -c {changed_mb}M /dev/urandom > /root/blob")
            saved = await sbx.snapshot(f"bench-bytes-{changed_mb}", overwrite=True)
            stored = saved.stored_bytes / 1e6
            figures.append(
                summarize(
                    f"snapshot-{changed_mb}MB-changed",
                    [stored],
                    "MB",
                    baseline="bytes changed",
                    base_value=changed_mb * 1.048576,
                    note="allocated bytes of a memory snapshot (RAM file + "
                    "device state + disk layer)",
                )
            )
            await AsyncSandbox.delete_snapshot(saved.id)
    finally:
        await sbx.kill()
    return figures


async def freed_memory(ctx: Context) -> list[Figure]:
    measured = await bench_saved.freed_memory(ctx.quick)
    used = f"MB the guest uses ({measured.used_mb:.0f})"
    note = f"a process filled {bench_saved.FREED_MB // (4 if ctx.quick else 1)} MB and exited"
    return [
        summarize(
            f"freed-memory-{what}",
            [ram_mb],
            "MB",
            baseline=used,
            base_value=measured.used_mb,
            note=f"RAM file of the {what} ({seconds:.2f} s); {note}",
        )
        for what, ram_mb, seconds in (
            ("snapshot", measured.snapshot_ram_mb, measured.snapshot_s),
            ("pause", measured.paused_ram_mb, measured.pause_s),
        )
    ]


async def history(ctx: Context) -> list[Figure]:
    measured = await bench_saved.history(ctx.quick)
    every = f"checkpoint_every={measured.every:g}"
    return [
        summarize(
            "history-checkpoint-stop",
            measured.stopped_ms,
            "ms",
            note=f"guest stopped per automatic checkpoint, {bench_saved.CHANGED_MB} MB "
            f"changed since the one before ({every})",
        ),
        summarize(
            "history-checkpoint-stored",
            measured.stored_mb,
            "MB",
            baseline="MB changed",
            base_value=bench_saved.CHANGED_MB * 1.048576,
            note="on the host's disk per automatic checkpoint once the next is taken: its "
            "RAM and its disk layer's file, each as the pages that differ from the next "
            "one's, and its device state",
        ),
        summarize(
            "history-checkpoint-ram",
            measured.ram_mb,
            "MB",
            baseline="MB changed",
            base_value=bench_saved.CHANGED_MB * 1.048576,
            note="of which its RAM",
        ),
        summarize(
            "history-suite-rounds",
            [measured.rounds_with],
            "rounds",
            baseline="rounds without a history",
            base_value=measured.rounds_without,
            note=f"a CPU-bound suite for {2 * measured.every + 1:g} s with {every} "
            "(ratio 1: no slowdown)",
        ),
    ]


async def file_transfer(ctx: Context) -> list[Figure]:
    """Files in and out of a sandbox, embedded and over HTTP, beside the guest's own read
    of the same file from its disk in the same run."""
    figures = []
    async with bench_http.running_server() as (url, key):
        for label, where in (("", {}), ("-http", {"api_url": url, "api_key": key})):
            measured = await bench_saved.file_transfer(ctx.quick, **where)
            disk = statistics.median(measured.disk_read)
            over = "over HTTP (SDK -> server -> sandbox)" if label else "embedded"
            for way, rates in (("write", measured.write), ("read", measured.read)):
                figures.append(
                    summarize(
                        f"file-{way}{label}",
                        rates,
                        "MB/s",
                        baseline="the guest's own read of it",
                        base_value=disk,
                        note=f"{measured.mb:.0f} MB of random bytes through files.{way}, "
                        f"{over}; the guest reads the file from its disk (dd, page cache "
                        f"dropped) at a median {disk:.0f} MB/s",
                    )
                )
    return figures


async def shape(ctx: Context) -> list[Figure]:
    """A template of one's own created with more vCPUs and RAM: the first create of a
    shape (a variant made: restore, hot-plug, save) and later ones (the variant
    restored), against the template's own restore and a cold boot."""
    measured = await bench_shapes.run(ctx.quick)
    (cpus, kib), (grown_cpus, grown_kib) = measured.shapes
    seen = (
        f"the guest saw {cpus} vCPUs and {kib >> 10} MiB, grown {grown_cpus} and {grown_kib >> 10}"
    )
    return [
        summarize(
            "shape-same",
            measured.same,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="create(template=yours) at its own shape, to first command",
        ),
        summarize(
            "shape-first",
            measured.first,
            "s",
            baseline="cold boot",
            base_value=ctx.cold_boot_s,
            note="the first create of a shape with +1 vCPU and +1 GiB (or more): restore, "
            f"plug in, bring online, save the variant, restore it; {seen}",
        ),
        summarize(
            "shape-later",
            measured.later,
            "s",
            baseline="shape-same",
            base_value=statistics.median(measured.same),
            note="later creates of that shape: the kept variant restored",
        ),
    ]


async def cli_start(ctx: Context) -> list[Figure]:
    """``cryobox ls`` and ``cryobox exec ID -- true`` as new processes, beside the same
    calls in a running process; the CLI's overhead is the difference of the medians."""
    measured = await bench_cli.run(ctx.quick)
    python = statistics.median(measured.python)
    figures = [
        summarize("cli-python", measured.python, "s", note="python -c pass: the interpreter"),
        summarize("cli-version", measured.version, "s", note="cryobox --version: imports only"),
    ]
    for name, command, wall, inside, call in (
        ("ls", "ls", measured.ls, measured.ls_in_process, "Sandbox.list()"),
        (
            "exec",
            "exec ID -- true",
            measured.exec,
            measured.exec_in_process,
            'commands.run(["true"])',
        ),
    ):
        operation = statistics.median(inside)
        overhead = statistics.median(wall) - operation
        figures.append(
            summarize(
                f"cli-{name}",
                wall,
                "s",
                baseline=f"{call} in a running process",
                base_value=operation,
                note=f"cryobox {command} as a new process;"
                f" CLI overhead {overhead:.3f} s (target 0.3 s), of which the interpreter "
                f"{python:.3f} s; {call} alone {operation:.3f} s",
            )
        )
    return figures


async def volumes(ctx: Context) -> list[Figure]:
    """A named volume against the guest's own disk in the same guest, and what a mount
    adds to a pause, its resume and a fork of 3 (against a sandbox without one)."""
    measured = await bench_volumes.run(ctx.quick)
    figures = []
    for name, rates in (("write", measured.write), ("read", measured.read)):
        figures.append(
            summarize(
                f"volume-{name}",
                rates["volume"],
                "MB/s",
                baseline="the root disk, same guest",
                base_value=statistics.median(rates["root"]),
                note=f"{measured.mb} MB sequential (dd bs=1M, conv=fsync on write, caches "
                f"dropped before the read); root disk median "
                f"{statistics.median(rates['root']):.0f} MB/s",
            )
        )
    figures.append(
        summarize(
            "volume-small-files",
            measured.creates["volume"],
            "files/s",
            baseline="the root disk, same guest",
            base_value=statistics.median(measured.creates["root"]),
            note=f"{measured.files} files of a line each made by the shell, then sync",
        )
    )
    for name, seconds in (
        ("pause", measured.pause),
        ("resume", measured.resume),
        ("fork-3", measured.fork),
    ):
        figures.append(
            summarize(
                f"volume-{name}",
                seconds["volume"],
                "s",
                baseline="the same without a volume",
                base_value=statistics.median(seconds["none"]),
                note=f"with one volume mounted; without: median "
                f"{statistics.median(seconds['none']):.3f} s",
            )
        )
    return figures


async def guest_flood(ctx: Context) -> list[Figure]:
    before, peak, logs = await bench_bounds.flood(ctx.quick)
    streamed = bench_bounds.FLOOD_BYTES / (10 if ctx.quick else 1) / 2**20
    from cryobox.sandbox.supervisor import CONSOLE_MAX_BYTES, LOG_MAX_BYTES, OUTPUT_HIGH

    return [
        summarize(
            "flood-supervisor-growth",
            [peak - before],
            "MiB",
            baseline="MiB streamed to a client that did not read",
            base_value=streamed,
            note=f"supervisor RSS {before:.0f} -> peak {peak:.0f} MiB; flow control "
            f"pauses the command past {OUTPUT_HIGH >> 20} MiB held",
        ),
        summarize(
            "garbage-logs",
            [logs],
            "MiB",
            baseline="the logs' cap",
            base_value=2 * (LOG_MAX_BYTES + CONSOLE_MAX_BYTES) / 2**20,
            note="all logs of a sandbox after 20 MB of random bytes on its agent port",
        ),
    ]


async def run_scenarios(names: tuple[str, ...], quick: bool = False) -> list[Figure]:
    """Run the named scenarios (their baselines first); ``quick`` is the smoke mode."""
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    ctx = Context(quick=quick)
    # Background uploads would compete with every figure for the cores: the store
    # scenario pushes in the foreground and times it. So would pool refills: the pool is
    # on only where template-start measures it.
    os.environ.setdefault("CRYOBOX_STORE_UPLOAD", "off")
    os.environ["CRYOBOX_POOL_SIZE"] = "0"
    ctx.disk_mb_s = await asyncio.to_thread(disk_bandwidth_mb_s, 64 if quick else 256)
    figures = [
        Figure(
            "disk-write",
            "MB/s",
            1,
            round(ctx.disk_mb_s, 1),
            round(ctx.disk_mb_s, 1),
            round(ctx.disk_mb_s, 1),
            note="dd conv=fsync: baseline for pause",
        )
    ]
    figures += await cold_boot(ctx)
    if "diy" in names:
        figures += await diy(ctx)
    if {"exec", "ping", "guest-spawn"} & set(names):
        figures += await exec_and_channel(ctx, names)
    if "template-start" in names:
        figures += await template_start(ctx)
    if {"pause", "resume"} & set(names):
        figures += await pause_resume(ctx, names)
    if {"checkpoint", "rollback"} & set(names):
        figures += await checkpoint_rollback(ctx)
    if "fork" in names:
        figures += await fork(ctx)
    if "translation" in names:
        figures += await translation(ctx)
    if "restore-vs-ram" in names:
        figures += await restore_vs_ram(ctx)
    if "snapshot-bytes" in names:
        figures += await snapshot_bytes(ctx)
    if "freed-memory" in names:
        figures += await freed_memory(ctx)
    if "history" in names:
        figures += await history(ctx)
    if "file-transfer" in names:
        figures += await file_transfer(ctx)
    if "volumes" in names:
        figures += await volumes(ctx)
    if "guest-flood" in names:
        figures += await guest_flood(ctx)
    if {"http-exec", "http-get"} & set(names):
        figures += await http_api(ctx, names)
    if "store" in names:
        figures += await store(ctx)
    if "cli-start" in names:
        figures += await cli_start(ctx)
    if "shape" in names:
        figures += await shape(ctx)
    for template in ctx.made_templates:  # leave no benchmark templates behind
        await AsyncSandbox.delete_template(template)
    return with_diy(figures, ctx.diy)


async def diy(ctx: Context) -> list[Figure]:
    """Plain QEMU by hand on the same image, in this run (:mod:`.diy`)."""
    runs = 1 if ctx.quick else 3
    figures = ctx.diy = await bench_diy.measure(runs, 3 if ctx.quick else 10)
    what = "plain QEMU by hand, same image and machine: "
    return [
        summarize("diy-cold-boot", figures.cold_boot, "s", note=what + "boot to first command"),
        summarize(
            "diy-loadvm-start",
            figures.loadvm_start,
            "s",
            note=what + "a new QEMU with -loadvm (internal snapshot) to first command",
        ),
        summarize("diy-savevm", figures.savevm, "s", note=what + "savevm on the running VM"),
        summarize(
            "diy-cont", figures.cont, "s", note=what + "stop, then cont: cont to first command"
        ),
        summarize(
            "diy-rollback", figures.rollback, "s", note=what + "loadvm, to first command after"
        ),
        summarize(
            f"diy-fork-{figures.fork_count}",
            [figures.fork],
            "s",
            note=what + f"{figures.fork_count} copies of the saved overlay started with "
            "-loadvm, all answering (copying included)",
        ),
        summarize(
            f"diy-fork-{figures.fork_count}-pss",
            [figures.fork_pss_mib],
            "MiB",
            note=what + f"sum of PSS of the {figures.fork_count} QEMUs",
        ),
    ]


def with_diy(figures: list[Figure], measured: bench_diy.DiyFigures | None) -> list[Figure]:
    """Each cryobox figure beside its plain-QEMU counterpart from the same run."""
    if measured is None:
        return figures
    median = statistics.median
    counterparts = {
        "cold-boot": median(measured.cold_boot),
        "template-start": median(measured.loadvm_start),
        "template-restore": median(measured.loadvm_start),
        "resume": median(measured.cont),
        "resume-released": median(measured.loadvm_start),
        "checkpoint": median(measured.savevm),
        "rollback": median(measured.rollback),
        f"fork-{measured.fork_count}": measured.fork,
        f"fork-{measured.fork_count}-pss": measured.fork_pss_mib,
        f"fork-{measured.fork_count}-all-pss": measured.fork_pss_mib,
    }
    out = []
    for figure in figures:
        base = counterparts.get(figure.scenario)
        if base:
            figure = dataclasses.replace(
                figure, diy=round(base, 3), diy_ratio=round(figure.median / base, 3)
            )
        out.append(figure)
    return out


def machine(accelerator: str) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "qemu": qemu_version(),
        "accelerator": accelerator,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def run(names: tuple[str, ...], quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    figures = asyncio.run(run_scenarios(names, quick))
    from cryobox.image import ensure_image
    from cryobox.qemu.accel import detect_accelerator

    image = ensure_image()
    return figures, machine(detect_accelerator(image.kernel, image.initrd))


def to_json(figures: list[Figure], host: dict[str, Any]) -> str:
    return json.dumps({"machine": host, "figures": [asdict(f) for f in figures]}, indent=2)


def to_markdown_table(figures: list[Figure]) -> str:
    lines = [
        "| scenario | median | p90 | min | runs | ratio to baseline "
        "| plain QEMU by hand | ratio to it | what |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        ratio = f"{f.ratio} x {f.baseline}" if f.ratio is not None else "-"
        diy = f"{f.diy} {f.unit}" if f.diy is not None else "-"
        diy_ratio = f"{f.diy_ratio} x" if f.diy_ratio is not None else "-"
        lines.append(
            f"| {f.scenario} | {f.median} {f.unit} | {f.p90} {f.unit} | {f.min} {f.unit} "
            f"| {f.runs} | {ratio} | {diy} | {diy_ratio} | {f.note} |"
        )
    return "\n".join(lines)


def plot(figures: list[Figure], path: Path) -> None:
    """A bar chart of every timed figure against its baseline (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'cryobox[bench]'") from exc
    timed = [f for f in figures if f.unit == "s"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(timed) + 1.5))
    ax.barh([f.scenario for f in timed], [f.median for f in timed], color="#4477aa")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (median, log scale)")
    ax.set_title("cryobox bench")
    for index, f in enumerate(timed):
        label = f"{f.median:g} s" + (f"  ({f.ratio:g} x {f.baseline})" if f.ratio else "")
        ax.text(f.median, index, " " + label, va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def store(ctx: Context) -> list[Figure]:
    found = await bench_store.measure(ctx.quick)
    ram_mb = found["ram_bytes"] / 1e6
    save_mb_s = statistics.median(found["save_mb_s"])
    local_start = statistics.median(found["local_start_s"])

    def against_local(scenario: str, samples: list[float], note: str) -> Figure:
        return summarize(
            scenario,
            samples,
            "s",
            baseline="start from the same snapshot, local",
            base_value=local_start,
            note=note,
        )

    disk_mb_s = statistics.median(found["disk_mb_s"])
    return [
        summarize(
            "store-second-snapshot",
            [100 * found["second_bytes"] / found["ram_bytes"]],
            "% of RAM",
            baseline="% of RAM changed",
            base_value=100 * found["changed_mb"] * 1e6 / found["ram_bytes"],
            note=f"bytes a second snapshot added to the chunk store after "
            f"{found['changed_mb']} MB of a {ram_mb:.0f} MB guest's RAM changed "
            "(random data: incompressible)",
        ),
        summarize(
            "store-save",
            found["save_mb_s"],
            "MB/s",
            baseline="dd of as many MB right after",
            base_value=disk_mb_s,
            note=f"first push of a snapshot into a fresh local folder store, after a sync: "
            f"{found['save_bytes'] / 1e6:.0f} MB written (hashed, zstd, AES-GCM, fsync); "
            f"dd conv=fsync of as many bytes right after each: "
            + ", ".join(f"{d:.0f}" for d in found["disk_mb_s"])
            + " MB/s",
        ),
        summarize(
            "store-upload-s3",
            [found["upload_bytes"] / 1e6 / found["upload_s"]],
            "MB/s",
            baseline="store-save",
            base_value=save_mb_s,
            note=f"the same snapshot pushed to SeaweedFS on loopback: "
            f"{found['upload_bytes'] / 1e6:.0f} MB",
        ),
        summarize(
            "store-pull-s3",
            [found["pull_s"]],
            "s",
            note=f"pull of that snapshot from S3 with no local copy of any chunk: "
            f"{found['pull_bytes'] / 1e6:.0f} MB rebuilt and checked",
        ),
        summarize(
            "store-second-snapshot-host",
            [100 * found["host_added_cached"] / found["ram_bytes"]],
            "% of RAM",
            baseline="the same with its RAM kept here too",
            base_value=100 * found["host_added_whole"] / found["ram_bytes"],
            note="bytes the host's disk (state folder and local folder store together) "
            "gained by that second snapshot, pushed, its RAM then left for the store as "
            "CRYOBOX_LOCAL_CACHE_GIB=0 lets it go; baseline: before it went (the "
            "default, no bound)",
        ),
        against_local(
            "store-cache-start",
            found["cache_start_s"],
            "create(from_snapshot=) to first command of that snapshot, its RAM "
            "brought back into its folder first (chunks its first snapshot's RAM holds "
            "read from there, checked; the rest from the local store)",
        ),
        summarize(
            "store-local-start",
            found["local_start_s"],
            "s",
            note="create(from_snapshot=) to first command of the snapshot below, from its "
            "local files (its RAM file copied for the sandbox): once before and once in "
            "each turn of the two below",
        ),
        against_local(
            "store-remote-start-whole",
            found["remote_whole_start_s"],
            "create(from_snapshot=) to first command after its local files were "
            "evicted, pulled whole first (CRYOBOX_LAZY_PULL=0): from S3, chunks shared "
            "with a local snapshot read from disk",
        ),
        against_local(
            "store-remote-start",
            found["remote_start_s"],
            "the same start, its RAM served as it arrives (each 1 MiB window fetched "
            "on first read, the rest in the background); taken in turns with the one above",
        ),
        summarize(
            "store-remote-arrived",
            found["arrived_s"],
            "s",
            note="from that create until all its RAM was here and checked",
        ),
    ]


async def http_api(ctx: Context, names: tuple[str, ...]) -> list[Figure]:
    figures = []
    async with bench_http.running_server() as (url, key):
        if "http-exec" in names:
            over_http, embedded = await bench_http.exec_over_both(
                url, key, 10 if ctx.quick else 100
            )
            figures.append(
                summarize(
                    "http-exec-embedded",
                    embedded,
                    "ms",
                    scale=1000,
                    note="`true` on the server's sandbox through this process's own service",
                )
            )
            figures.append(
                summarize(
                    "http-exec",
                    over_http,
                    "ms",
                    scale=1000,
                    baseline="http-exec-embedded",
                    base_value=statistics.median(embedded) * 1000,
                    note="`true` via SDK -> HTTP -> server -> supervisor -> agent (interleaved)",
                )
            )
        if "http-get" in names:
            rates = await bench_http.gets_per_second(
                url, key, 2 if ctx.quick else 5, 4 if ctx.quick else 40
            )
            figures.append(
                summarize(
                    "http-get",
                    rates,
                    "req/s",
                    note=f"GET /sandboxes/{{id}}, {bench_http.CLIENTS} concurrent clients, "
                    "server and load on the same cores",
                )
            )
    return figures


INTRO = (
    "Regenerate with `make bench` (`cryobox bench --markdown docs/BENCHMARKS.md`). "
    "Medians, p90 and minimum over repeated runs in one session, each beside its "
    "baseline measured in the same run. No test passes or fails on these: the "
    'machines are shared and noisy. The columns "plain QEMU by hand" and "ratio to it" '
    "hold what a user gets without cryobox, measured in the same run on the same image "
    "(`cryobox.bench.diy`, the `diy-*` rows: QEMU started by hand, savevm/loadvm, forks as "
    "copies of the saved disk; its guest keeps the kernel's default address randomization, "
    "as a user's would)."
)
ANCHORS = """| system | figure | published |
|---|---|---|
| Firecracker | microVM boot | as little as 125 ms |
| E2B | pause | about 4 s per GiB of RAM |
| E2B | resume | about 1 s |
| E2B | fork | at most 100 per call |
| forkd | 100 VMs started | 101 ms |
| Zeroboot | one fork (MAP_PRIVATE of a snapshot's memory) | 0.79 ms |
| CodeSandbox | clone (fork) of a running VM | about 2 s |

Theirs are on KVM hardware; ours here run under TCG (QEMU's emulator), which
translates every guest instruction and re-translates all guest code in each new
QEMU process: restores and forks pay that warm-up, cold boots pay it too."""


#: docs/BENCHMARKS.md from this heading on is written by `make soak` and `make torture`
#: runs, not by the bench: a regeneration keeps it as it is.
KEPT_SECTION = "## Reliability: soak and torture"


def kept_section(existing: str) -> str:
    """The part of an existing BENCHMARKS.md that a regeneration keeps ('' if none)."""
    at = existing.find(KEPT_SECTION)
    return existing[at:].rstrip() + "\n" if at >= 0 else ""


def to_markdown_document(
    figures: list[Figure], host: dict[str, Any], quick: bool, kept: str = ""
) -> str:
    """docs/BENCHMARKS.md, regenerated from a run (``kept``: :func:`kept_section`)."""
    head = (
        f"## {host['date']}: {host['cores']} cores ({host['cpu']}), {host['memory_gib']} GiB, "
        f"kernel {host['kernel']}, QEMU {host['qemu']}, {host['accelerator'].upper()}"
    )
    mode = " (quick mode: small counts)" if quick else ""
    return (
        "\n\n".join(
            [
                "# Benchmarks",
                INTRO,
                head + mode,
                to_markdown_table(figures),
                "![the timed figures, log scale](bench.png)",
                "## Published anchors",
                ANCHORS,
                *([kept.rstrip()] if kept else []),
            ]
        )
        + "\n"
    )
