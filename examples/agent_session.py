"""A realistic agent session, end to end, on the embedded defaults.

An agent writes a small Python package with its tests in a sandbox, installs a
dependency when the guest can reach PyPI (and says clearly that it skipped it when not),
runs the tests, serves the package on a port, checkpoints, breaks it, rolls back, then
forks three variants of a new feature and keeps the one whose tests pass.

Run with ``.venv/bin/python examples/agent_session.py``; it exits non-zero if any step
does not do what it should (CI runs it: tests/integration/test_examples_vm.py).
"""

from __future__ import annotations

import json
import time
import urllib.request

from cryobox import Sandbox

PROJECT = "/root/calc"

PACKAGE = '''\
"""A tiny calculator: what the agent is building."""


def add(a, b):
    return a + b
'''

TESTS = """\
import os
import unittest

import calc


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(calc.add(2, 3), 5)

    def test_environment_reaches_the_tests(self):
        self.assertEqual(os.environ["APP_ENV"], "test")

    @unittest.skipUnless(hasattr(calc, "mul"), "mul is not written yet")
    def test_mul(self):
        self.assertEqual(calc.mul(4, 5), 20)
        self.assertEqual(calc.mul(3, -2), -6)


if __name__ == "__main__":
    unittest.main()
"""

SERVER = """\
import json
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import calc


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        query = {k: int(v[0]) for k, v in parse_qs(urlparse(self.path).query).items()}
        body = json.dumps({"sum": calc.add(query["a"], query["b"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
"""

#: Three attempts at the next feature; only one is right.
VARIANTS = {
    "mul-by-repeated-add": "\n\ndef mul(a, b):\n    return sum(a for _ in range(b))\n",
    "mul-by-operator": "\n\ndef mul(a, b):\n    return a * b\n",
    "mul-by-power": "\n\ndef mul(a, b):\n    return a**b\n",
}

PYPI_PROBE = (
    "python3 -c 'import urllib.request as u; u.urlopen(\"https://pypi.org/simple/\", timeout=8)'"
)


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"agent session: FAILED: {what}")


def step(label: str, started: list[float]) -> None:
    now = time.monotonic()
    print(f"  {label:<66} {now - started[0]:6.2f} s", flush=True)
    started[0] = now


def fetch_sum(port: int, a: int, b: int) -> int:
    url = f"http://127.0.0.1:{port}/?a={a}&b={b}"
    for _ in range(120):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(json.load(response)["sum"])
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"agent session: FAILED: the server never answered on {url}")


def run_tests(sbx: Sandbox) -> tuple[bool, str]:
    result = sbx.commands.run("python3 -m unittest discover -s tests -v", cwd=PROJECT)
    return result.exit_code == 0, result.stderr.strip().splitlines()[-1]


def main() -> None:
    print("cryobox agent session: write, test, serve, checkpoint, break, roll back, fork")
    started = [time.monotonic()]
    with Sandbox.create(
        ports=[8000], envs={"APP_ENV": "test"}, metadata={"example": "agent-session"}
    ) as sbx:
        step(f"created {sbx.id}", started)

        sbx.files.write(f"{PROJECT}/calc/__init__.py", PACKAGE)  # folders are made
        sbx.files.write(f"{PROJECT}/tests/test_calc.py", TESTS)
        sbx.files.write(f"{PROJECT}/serve.py", SERVER)
        step("wrote the package, its tests and a server", started)

        probe = sbx.commands.run(PYPI_PROBE, timeout=30)
        if probe.exit_code == 0:
            # Into the project's own folder (a venv's own pip takes minutes under TCG).
            pip = sbx.commands.run(
                "python3 -m pip install -q --no-input --disable-pip-version-check"
                f" --target {PROJECT}/vendor six",
                env={"PIP_ROOT_USER_ACTION": "ignore"},
                timeout=600,
            )
            check(pip.exit_code == 0, f"pip install: {pip.stderr[-500:]}")
            used = sbx.commands.run(
                "python3 -c 'import six; print(six.__version__)'", cwd=f"{PROJECT}/vendor"
            )
            check(used.exit_code == 0, f"the installed dependency imports: {used.stderr}")
            step(f"pip-installed a dependency (six {used.stdout.strip()})", started)
        else:
            why = (probe.stderr.strip().splitlines() or ["timed out"])[-1][:60]
            step(f"SKIPPED pip install: no pypi.org from the guest ({why})", started)

        passed, summary = run_tests(sbx)
        check(passed, f"the first tests: {summary}")
        step(f"ran the tests: {summary}", started)

        sbx.commands.run(
            f"cd {PROJECT} && nohup python3 serve.py >/tmp/serve.log 2>&1 &", timeout=30
        )
        port = sbx.ports[8000]
        check(fetch_sum(port, 2, 3) == 5, "the server adds")
        step(f"served it: GET 127.0.0.1:{port}/?a=2&b=3 -> 5", started)

        green = sbx.checkpoint("green")
        step(f"checkpoint {green.name} (memory and disk)", started)

        sbx.files.write(f"{PROJECT}/calc/__init__.py", PACKAGE.replace("a + b", "a - b"))
        passed, summary = run_tests(sbx)
        check(not passed, "the broken package failed its tests")
        step(f"broke it: {summary}", started)

        sbx.rollback(green)
        passed, summary = run_tests(sbx)
        check(passed, f"tests after the rollback: {summary}")
        check(fetch_sum(port, 20, 22) == 42, "the server still runs after the rollback")
        step("rolled back: tests pass, the server never stopped", started)

        forks = sbx.fork(len(VARIANTS))
        step(f"forked {len(forks)} variants", started)
        winners = []
        try:
            for fork, (name, code) in zip(forks, VARIANTS.items(), strict=True):
                fork.files.write(f"{PROJECT}/calc/__init__.py", PACKAGE + code)
                passed, summary = run_tests(fork)
                print(f"    {name:<22} {fork.id}: {'PASS' if passed else 'FAIL'} ({summary})")
                if passed:
                    winners.append((name, fork))
            check(len(winners) == 1, f"exactly one variant passes, not {len(winners)}")
            name, fork = winners[0]
            check(fork.commands.run("hostname").stdout.strip() == fork.id, "forks have own ids")
            step(f"picked {name} ({fork.id})", started)
        finally:
            for fork in forks:
                fork.kill()
    print("agent session: done")


if __name__ == "__main__":
    main()
