"""The web console in a real browser (Debian's Chromium, driven by Playwright) against a
real ``cryobox server`` and real VMs: sign in, create, a command typed in the terminal,
a checkpoint, a broken file, the rollback clicked on the history tree, a fork from a
node, a hostile file name shown as text, the usage page; and how fast 100 sandboxes and
a lineage of 200 nodes render.

``CRYOBOX_CONSOLE_SHOTS=docs/console`` saves the screenshots there (the README's).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import sync_playwright

from api_server import ApiServer
from waiting import until

pytestmark = pytest.mark.vm

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CRYOBOX_CONSOLE_SHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/")
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_selector("#sandboxes")


def test_a_user_works_checkpoints_breaks_and_travels_back_in_the_browser(
    page: Any, api_server: ApiServer, tmp_path: Path
) -> None:
    key = api_server.tenant(f"console-{os.urandom(3).hex()}")
    api = httpx.Client(
        base_url=api_server.url, headers={"Authorization": f"Bearer {key}"}, timeout=300
    )
    folder = shots(tmp_path)
    dialogs: list[str] = []

    def refuse(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", refuse)
    page.goto(f"{api_server.url}/")
    page.fill("input[name=key]", "cbx_wrong")
    page.click("button[type=submit]")
    page.wait_for_selector(".sign-in .error:not([hidden])")
    page.screenshot(path=str(folder / "sign-in.png"))
    # Another tenant's sandbox, running meanwhile: never on this tenant's pages.
    theirs = httpx.Client(
        base_url=api_server.url, headers={"Authorization": f"Bearer {api_server.key}"}, timeout=300
    )
    stranger = theirs.post("/sandboxes", json={}).json()["id"]
    sign_in(page, api_server.url, key)
    try:
        page.click("#create")
        row = page.wait_for_selector("tr[data-id] .state.running", timeout=300_000)
        sandbox = row.evaluate("node => node.closest('tr').dataset.id")
        assert page.locator("tr[data-id]").count() == 1
        assert page.locator(f"tr[data-id='{stranger}']").count() == 0
        assert "sbx-" not in page.inner_text("#sandboxes").replace(sandbox, "")
        page.screenshot(path=str(folder / "sandboxes.png"))

        # The terminal: a login shell in the guest, typed into.
        page.click(f"a[href='#/sandbox/{sandbox}']")
        page.wait_for_selector("#terminal .xterm-rows")
        page.click("#terminal")
        page.keyboard.type("echo good > /root/app.txt; echo hello-$((6*7))\n")
        terminal = page.locator("#terminal .xterm-rows")
        until(lambda: "hello-42" in terminal.inner_text(), "the terminal's output", timeout=60)
        until(lambda: "[cryobox]" in page.inner_text("#logs"), "the console log", timeout=30)
        page.screenshot(path=str(folder / "sandbox.png"))

        # A checkpoint, then the file broken from the terminal.
        page.click("#info button[data-action=checkpoint]")
        until(
            lambda: (
                "checkpoint" in page.inner_text("#status") and "done" in page.inner_text("#status")
            ),
            "the checkpoint",
        )
        [point] = api.get(f"/sandboxes/{sandbox}/checkpoints").json()
        page.click("#terminal")
        page.keyboard.type("echo broken > /root/app.txt\n")
        until(
            lambda: (
                api.get(f"/sandboxes/{sandbox}/files", params={"path": "/root/app.txt"}).text
                == "broken\n"
            ),
            "the broken file",
        )

        # Back to the checkpoint from the history tree.
        page.goto(f"{api_server.url}/#/history")
        node = page.wait_for_selector(f"g.node[data-id='{point['id']}']")
        node.click()
        page.click(f"#node-menu button:has-text('Roll {sandbox} back to it')")
        until(
            lambda: (
                api.get(f"/sandboxes/{sandbox}/files", params={"path": "/root/app.txt"}).text
                == "good\n"
            ),
            "the file as it was at the checkpoint",
        )

        # A fork from the sandbox's node.
        page.click(f"g.node[data-id='{sandbox}']")
        page.click("#node-menu button:has-text('Fork it')")
        until(
            lambda: any(s["forked_from"] == sandbox for s in api.get("/sandboxes").json()),
            "the fork",
            timeout=300,
        )
        until(lambda: page.locator("g.node.sandbox").count() >= 2, "the fork in the tree")
        page.screenshot(path=str(folder / "history.png"))

        # A new sandbox from the checkpoint's node: it has the file as it was then.
        page.click(f"g.node[data-id='{point['id']}']")
        page.click("#node-menu button:has-text('Start a sandbox from it')")
        until(
            lambda: any(s["origin"] == point["id"] for s in api.get("/sandboxes").json()),
            "a sandbox started from the checkpoint",
            timeout=300,
        )
        [started] = [s for s in api.get("/sandboxes").json() if s["origin"] == point["id"]]
        then = api.get(f"/sandboxes/{started['id']}/files", params={"path": "/root/app.txt"})
        assert then.text == "good\n"

        # A hostile file name is shown as text: nothing runs, no element is made of it.
        api.put(f"/sandboxes/{sandbox}/files", params={"path": f"/root/{HOSTILE}"}, content=b"x")
        api.post(f"/sandboxes/{sandbox}/snapshots", json={"name": HOSTILE[:60].replace("/", "")})
        page.goto(f"{api_server.url}/#/sandbox/{sandbox}")
        page.wait_for_selector(f"#files li.entry:has-text('{HOSTILE}')")
        assert page.locator("#files img").count() == 0

        # Upload and download through the file browser.
        local = tmp_path / "notes.txt"
        local.write_text("uploaded from the browser\n")
        page.set_input_files("#upload", str(local))
        until(
            lambda: (
                api.get(f"/sandboxes/{sandbox}/files", params={"path": "/root/notes.txt"}).text
                == "uploaded from the browser\n"
            ),
            "the uploaded file in the guest",
        )
        page.wait_for_selector("#files li.entry:has-text('notes.txt')")
        with page.expect_download() as download:
            page.click("#files li.entry a:text-is('app.txt')")
        assert Path(download.value.path()).read_text() == "good\n"
        page.goto(f"{api_server.url}/#/history")
        page.wait_for_selector("g.node[data-kind=snapshot]")
        page.wait_for_timeout(500)
        assert page.locator("img").count() == 0 and dialogs == []
        assert page.locator(f"g.node[data-id='{stranger}']").count() == 0

        page.goto(f"{api_server.url}/#/usage")
        page.wait_for_selector("#usage h2")
        assert "So far: $" in page.inner_text("#usage h2")
        page.screenshot(path=str(folder / "usage.png"))
    finally:
        theirs.delete(f"/sandboxes/{stranger}")
        for info in api.get("/sandboxes").json():
            api.delete(f"/sandboxes/{info['id']}")
        for snap in api.get("/snapshots").json():
            api.delete(f"/snapshots/{snap['id']}", params={"cascade": "true"})


def synthetic(count: int, nodes: int) -> dict[str, Any]:
    """What the API would answer for a tenant with ``count`` sandboxes and a lineage of
    ``nodes`` nodes (a chain of checkpoints with forks off it)."""
    now = time.time()
    sandboxes = [
        {
            "id": f"sbx-{i:012x}",
            "state": ("running", "paused", "running")[i % 3],
            "template": "default",
            "cpus": 2,
            "memory_mib": 1024,
            "disk_gib": 4,
            "created_at": now - i * 60,
            "ports": {},
            "origin": None,
            "forked_from": None,
            "metadata": {"agent": f"a{i % 7}"},
        }
        for i in range(count)
    ]
    lineage = []
    for i in range(nodes):
        parent = f"node-{i - 1}" if i % 4 else (f"node-{i - 4}" if i else None)
        lineage.append(
            {
                "id": f"node-{i}",
                "kind": "sandbox" if i % 2 else "snapshot",
                "parent": parent,
                "state": "running" if i % 2 else "memory",
                "forked_from": None,
                "label": f"checkpoint {i}",
            }
        )
    usage = {
        "prices": {"vcpu_hour": 0.05, "gib_hour": 0.016, "gb_month": 0.08},
        "sandboxes": [],
        "cost_usd": {"compute": 0, "storage": 0, "total": 0},
    }
    return {"sandboxes": sandboxes, "lineage": lineage, "usage": usage, "snapshots": []}


def test_a_hundred_sandboxes_and_two_hundred_nodes_render_quickly(
    page: Any, api_server: ApiServer
) -> None:
    """The page's own work, measured in the browser with the API's answers served by
    the test (100 real VMs do not fit this machine); figure in docs/BENCHMARKS.md."""
    data = synthetic(100, 200)
    answers = {
        "/sandboxes": data["sandboxes"],
        "/usage": data["usage"],
        "/lineage": data["lineage"],
        "/snapshots": data["snapshots"],
    }

    def answer(route: Any) -> None:
        path = route.request.url.split(api_server.url, 1)[1].split("?", 1)[0]
        if path == "/events":
            route.fulfill(status=200, content_type="text/event-stream", body=": quiet\n\n")
        elif path in answers:
            route.fulfill(
                status=200, content_type="application/json", body=json.dumps(answers[path])
            )
        else:
            route.continue_()

    page.route(f"{api_server.url}/*", answer)
    page.route(f"{api_server.url}/*?*", answer)
    sign_in(page, api_server.url, "cbx_synthetic")
    start = time.monotonic()
    page.goto(f"{api_server.url}/#/history")
    page.locator("g.node").nth(199).wait_for(state="attached")
    drawn = time.monotonic() - start
    assert page.locator("g.node").count() == 200
    start = time.monotonic()
    page.goto(f"{api_server.url}/#/sandboxes")
    page.locator("#sandboxes tr[data-id]").nth(99).wait_for(state="attached")
    listed = time.monotonic() - start
    print(
        f"console: 100 sandboxes listed in {listed:.3f} s, 200 lineage nodes drawn in {drawn:.3f} s"
    )
    assert listed < 10 and drawn < 10  # the 2 s goal is judged in docs/BENCHMARKS.md
