"""An E2B user's session with the official Python SDK, unchanged, given only
``E2B_DOMAIN`` and ``E2B_API_KEY`` (and the operator's CA in ``SSL_CERT_FILE``): the SDK
calls ``https://api.DOMAIN`` and ``https://49983-ID.DOMAIN`` itself, as it does E2B's
cloud. Run by tests/compat/test_e2b_domain.py, which checks each line it prints."""

from __future__ import annotations

import os
import time

import e2b
import httpx

for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
    assert name not in os.environ, f"{name} is set: this session must use E2B_DOMAIN alone"

SERVE = "python3 -m http.server 8000 --directory /tmp/site"

sandbox = e2b.Sandbox.create(
    timeout=300,
    secure=True,
    network=e2b.SandboxNetworkOpts(allow_public_traffic=False),
)
try:
    print(f"sandbox: {sandbox.sandbox_id}")
    print(f"run: {sandbox.commands.run('echo hello-$((6*7))').stdout.strip()}")
    sandbox.files.write("/tmp/site/index.html", "served through the domain\n")
    print(f"read: {sandbox.files.read('/tmp/site/index.html').strip()}")
    url = sandbox.download_url("/tmp/site/index.html", use_signature_expiration=60)
    print(f"signed url host: {httpx.URL(url).host}")
    print(f"signed: {httpx.get(url, timeout=60).text.strip()}")
    altered = url.replace("signature=v1_", "signature=v1_A")
    print(f"altered: {httpx.get(altered, timeout=60).status_code}")
    elsewhere = url.replace(sandbox.sandbox_id, "sbx-000000000000")  # another sandbox's name
    print(f"under another name: {httpx.get(elsewhere, timeout=60).status_code}")

    sandbox.commands.run(SERVE, background=True, timeout=0)
    host = sandbox.get_host(8000)
    print(f"host: {host}")
    token = {"e2b-traffic-access-token": sandbox.traffic_access_token or ""}
    deadline = time.monotonic() + 60
    page = httpx.get(f"https://{host}/", headers=token, timeout=30)
    while page.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        page = httpx.get(f"https://{host}/", headers=token, timeout=30)
    print(f"port: {page.status_code} {page.text.strip()}")
    print(f"without token: {httpx.get(f'https://{host}/', timeout=30).status_code}")

    assert sandbox.pause() is True
    again = e2b.Sandbox.connect(sandbox.sandbox_id)
    print(f"after resume: {again.commands.run('cat /tmp/site/index.html').stdout.strip()}")
finally:
    sandbox.kill()
print("python sdk: done")
