"""Every route of the HTTP API, walked with a red team's bad inputs, answers a 4xx
(never a 5xx, never a dropped connection) whose body is valid JSON: NaN and Infinity
(Python's JSON reader takes them, so they used to reach the 422 answer that echoes the
input and fail its encoding), numbers past any bound, nesting past the reader's
recursion limit, NUL and newlines, ``../``, 5,000-character ids (issue 31)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from api_server import ApiServer, fake_server

BODIES = [
    '{"timeout": NaN}',
    '{"timeout": Infinity}',
    '{"seconds": -Infinity}',
    '{"cmd": NaN, "timeout": NaN}',
    '{"metadata": {"a": NaN}, "envs": {"B": Infinity}}',
    '{"timeout": 1e400}',
    '{"cpus": ' + "9" * 5000 + "}",
    "[" * 100_000 + "]" * 100_000,
    '{"timeout": ' + "[" * 800 + "]" * 800 + "}",  # deep enough to break the echo, not the reader
    '{"a":' * 3000 + "1" + "}" * 3000,
    "\x00",
    '"\\u0000"',
    "null",
    "{",
]
IDS = ["../etc", "a%00b", "a%0Ab", "x" * 5000, "%2e%2e%2f", "sbx-" + "0" * 5000]
#: Routes that stream until the client leaves: answered, but never ended by the server.
STREAMS = re.compile(r"/(events|logs|watch|stream)\b")


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    with fake_server("cbx-bad-", "red") as made:
        yield made


def _check(client: httpx.Client, method: str, path: str, body: str | None) -> str | None:
    """What was wrong with the answer, or None when it was a 4xx or a 2xx in JSON."""
    try:
        answer = client.request(
            method,
            path,
            content=body.encode() if body is not None else None,
            params={"path": "/root/../\x00x\n"} if "/files" in path else None,
        )
    except httpx.ReadTimeout:
        return None if STREAMS.search(path) else "no answer in time"
    except httpx.HTTPError as exc:
        return f"no answer: {exc!r}"
    if answer.status_code >= 500:
        return f"{answer.status_code}: {answer.text[:200]}"
    if answer.headers.get("content-type", "").startswith("application/json"):
        try:
            json.loads(answer.text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError as exc:
            return f"{answer.status_code} with a body that is not JSON: {exc}"
    return None


def test_every_route_answers_bad_input_with_a_4xx(server: ApiServer) -> None:
    headers = {"X-API-Key": server.key, "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=5) as client:
        real = client.post("/sandboxes", content="{}")
        assert real.status_code == 201, real.text
        real_id = real.json()["id"]
        spec = client.get("/openapi.json").json()
        failures: list[str] = []
        requests = 0
        for template, operations in spec["paths"].items():
            for method in operations:
                writes = method in ("post", "put", "patch")
                variable = "{" in template
                cases: list[tuple[str, str | None]] = []
                if variable:  # bad ids, with a harmless body
                    cases += [(i, "{}" if writes else None) for i in IDS]
                if writes:  # bad bodies, on a real sandbox
                    cases += [(real_id, body) for body in BODIES]
                if not cases:
                    cases = [(real_id, None)]
                for ident, body in cases:
                    path = re.sub(r"\{[^}]+\}", ident, template)
                    requests += 1
                    problem = _check(client, method.upper(), path, body)
                    if problem:
                        case = f"{method.upper()} {template} {ident[:12]!r} {str(body)[:30]!r}"
                        failures.append(f"{case}: {problem}")
        assert requests > 300, requests  # every route was walked
        assert failures == [], "\n".join(failures[:30])
        # A NaN is refused by name, not taken.
        answer = client.post("/sandboxes", content='{"timeout": NaN}')
        assert answer.status_code == 422
        assert answer.json()["detail"][0]["loc"] == ["body", "timeout"]
        assert answer.json()["detail"][0]["input"] == "nan"
