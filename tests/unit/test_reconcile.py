"""What a starting server does with a live sandbox no tenant owns (the VM tests in
``integration/test_server_crash_vm.py`` kill a real server mid-create)."""

from __future__ import annotations

import dataclasses

import pytest

from cryobox.server.hub import _orphaned
from specs import small_spec

BASE = small_spec("sbx-000000000001")
TENANTS = {"tn-aaaaaaaaaaaa": "acme"}


@pytest.mark.parametrize(
    ("changes", "verdict"),
    [
        ({"owner": "tn-aaaaaaaaaaaa"}, ""),  # given to its tenant
        ({"owner": "tn-bbbbbbbbbbbb"}, "its tenant tn-bbbbbbbbbbbb is gone"),
        ({"owner": "build:tn-aaaaaaaaaaaa"}, "a template build cut short"),
        ({"owner": "", "pooled": True}, "a claim from the warm pool cut short"),
        ({"owner": "tn-aaaaaaaaaaaa", "pooled": True}, ""),  # claimed whole
        ({"owner": "local"}, None),  # the CLI's or the embedded SDK's: not the server's
        ({"owner": ""}, None),  # made before owners were recorded
    ],
)
def test_each_kind_of_unowned_sandbox_is_settled_as_it_should(
    changes: dict[str, object], verdict: str | None
) -> None:
    found = _orphaned(dataclasses.replace(BASE, **changes), TENANTS)  # type: ignore[arg-type]
    if verdict:
        assert found is not None and found.startswith(verdict)
    else:
        assert found == verdict
