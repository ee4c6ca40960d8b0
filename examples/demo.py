"""The main job on the embedded defaults: boot a sandbox, use it, snapshot it, fork it.

Run with ``make demo``. Prints each step and how long it took on this host.
"""

from __future__ import annotations

import time
import urllib.request

from cryobox import Sandbox
from cryobox.config import pause_hold
from cryobox.service import pool

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/counter; sleep 0.2; done'"
    " >/dev/null 2>&1 &"
)


class Steps:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def done(self, label: str) -> None:
        print(f"  {label:<64} {time.monotonic() - self.started:6.2f} s")
        self.started = time.monotonic()


def fetch(url: str) -> str:
    for _ in range(120):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body: bytes = response.read()
                return body.decode().strip()
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the guest's web server never answered on {url}")


def main() -> None:
    print("cryobox demo: real Debian VMs under QEMU (TCG on this host)")
    step = Steps()
    told: list[str] = []

    def progress(line: str) -> None:
        told.append(line)
        print(line)

    with Sandbox.create(ports=[8000], progress=progress) as sbx:
        built = any("building the default template" in line for line in told)
        how = "template built by a cold boot, then restored" if built else "restored"
        step.done(f"created {sbx.id} ({how})")

        result = sbx.commands.run("python3 -c 'print(6*7)'")
        step.done(f"python3 -c 'print(6*7)' -> {result.stdout.strip()}")

        sbx.files.mkdir("/root/app")
        sbx.files.write("/root/app/index.html", "hello from inside the VM\n")
        sbx.commands.run("cd /root/app && python3 -m http.server 8000", background=True)
        sbx.commands.run(COUNTER)
        body = fetch(f"http://127.0.0.1:{sbx.ports[8000]}/index.html")
        step.done(f"a web server and a counter run in the guest -> {body!r}")

        checkpoint = sbx.checkpoint("before-rm")
        sbx.commands.run("rm -rf /root/app")
        sbx.rollback(checkpoint)
        kept = sbx.files.read_text("/root/app/index.html").strip()
        step.done(f"checkpoint, rm -rf /root/app, rollback -> {kept!r}")

        sbx.pause()
        hold = pause_hold()
        kept = f"QEMU held {hold:g} s" if hold else "QEMU gone"
        step.done(f"paused: RAM, devices and disk saved ({kept})")
        sbx = Sandbox.resume(sbx.id)
        body = fetch(f"http://127.0.0.1:{sbx.ports[8000]}/index.html")
        step.done(f"resumed: the web server still answers -> {body!r}")

        snapshot = sbx.snapshot("demo-machine", overwrite=True)  # the same name each run
        step.done(f"saved snapshot {snapshot.id} ({snapshot.kind})")

        forks = sbx.fork(3)
        step.done(f"forked 3 running copies: {', '.join(f.id for f in forks)}")
        for fork in forks:
            out = fork.commands.run(
                "echo fork $CRYOBOX_FORK_ID: counter $(cat /root/counter), "
                "$(head -c 4 /dev/urandom | od -An -tx1 | tr -d ' ')"
            )
            print("   ", out.stdout.strip())
            fork.kill()
        Sandbox.delete_snapshot(snapshot.id)
    print("  all the demo's sandboxes killed")
    if pool.sizes():
        print("  (the warm pool keeps restored sandboxes waiting: `cryobox pool drain` ends them)")


if __name__ == "__main__":
    main()
