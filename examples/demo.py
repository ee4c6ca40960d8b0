"""The main job on the embedded defaults: boot a real VM sandbox and use it.

Run with ``make demo``. Prints what it does and how long each step took.
"""

from __future__ import annotations

import time
import urllib.request

from cryobox import Sandbox


def step(label: str, started: float) -> None:
    print(f"  {label:<46} {time.monotonic() - started:6.2f} s")


def main() -> None:
    print("cryobox demo: a real Debian VM (QEMU, TCG on this host)")
    started = time.monotonic()
    with Sandbox.create(ports=[8000]) as sbx:
        step(f"created {sbx.id} (cold boot to exec-ready)", started)

        started = time.monotonic()
        result = sbx.commands.run("python3 -c 'print(6*7)'")
        step(f"python3 -c 'print(6*7)' -> {result.stdout.strip()}", started)

        started = time.monotonic()
        sbx.files.mkdir("/root/app")
        sbx.files.write("/root/app/index.html", "hello from inside the VM\n")
        listing = [entry.name for entry in sbx.files.list("/root/app")]
        step(f"wrote a file, listed /root/app -> {listing}", started)

        started = time.monotonic()
        sbx.commands.run("cd /root/app && python3 -m http.server 8000", background=True)
        url = f"http://127.0.0.1:{sbx.ports[8000]}/index.html"
        for _ in range(120):
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode().strip()
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"the guest's web server never answered on {url}")
        step(f"guest web server on {url} -> {body!r}", started)

        result = sbx.commands.run("uname -sr; nproc; free -m | awk '/Mem/{print $2\" MiB\"}'")
        print("  guest:", " | ".join(result.stdout.split("\n")[:3]))
    print("  sandbox killed; snapshot and fork come with the memory-snapshot work (not built yet)")


if __name__ == "__main__":
    main()
