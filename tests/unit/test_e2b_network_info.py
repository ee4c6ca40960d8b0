"""E2B's network options and how E2B's sandbox info shows a policy back
(cryobox.e2b.rest): each form of policy, read back by E2B's own SDK model."""

from __future__ import annotations

import pytest

from cryobox.e2b.rest import ALL_TRAFFIC, egress_policy, network_detail
from cryobox.network.policy import parse_policy

SECRET = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer t"}}}]}


@pytest.mark.parametrize(
    ("options", "internet", "shown"),
    [
        ({}, None, {"allowPublicTraffic": True}),
        ({}, False, {"allowPublicTraffic": True, "denyOut": [ALL_TRAFFIC]}),
        (
            {"allowOut": ["192.0.2.7"], "denyOut": [ALL_TRAFFIC]},
            None,
            # (an address as the filter holds it: a network of one)
            {"allowPublicTraffic": True, "allowOut": ["192.0.2.7/32"], "denyOut": [ALL_TRAFFIC]},
        ),
        (
            {"denyOut": ["198.51.100.0/24"], "rules": SECRET},
            None,
            {
                "allowPublicTraffic": True,
                "allowOut": [],
                "denyOut": ["198.51.100.0/24"],
                "rules": SECRET,
            },
        ),
    ],
)
def test_a_policy_set_the_e2b_way_is_shown_back_the_e2b_way(
    options: dict[str, object], internet: bool | None, shown: dict[str, object]
) -> None:
    requested = egress_policy(options, internet)
    resolved = {"api.example.com": ["192.0.2.80"]}
    if isinstance(requested, dict) and requested.get("headers"):
        requested = {**requested, "resolved": resolved}  # (no DNS in a unit test)
    kept = parse_policy(requested if requested is not None else "internet", resolve=False)
    assert network_detail(kept.to_json(), False, "") == shown


def test_the_options_for_requests_by_host_name_are_shown_and_e2bs_sdk_reads_it_all() -> None:
    e2b_models = pytest.importorskip("e2b.api.client.models")
    shown = network_detail({"allow": [], "deny": [], "headers": {}}, True, "${PORT}-x.test")
    assert shown == {
        "allowPublicTraffic": False,
        "maskRequestHost": "${PORT}-x.test",
        "allowOut": [],
        "denyOut": [],
    }
    read = e2b_models.SandboxNetworkConfig.from_dict(
        network_detail(["192.0.2.7"], False, "")
    ).to_dict()
    assert read == {"allowPublicTraffic": True, "allowOut": ["192.0.2.7"], "denyOut": [ALL_TRAFFIC]}
    with_rules = e2b_models.SandboxNetworkConfig.from_dict(
        network_detail({"allow": [], "deny": [], "headers": {"h.test": {"A": "b"}}}, False, "")
    )
    assert with_rules.rules.to_dict() == {"h.test": [{"transform": {"headers": {"A": "b"}}}]}
