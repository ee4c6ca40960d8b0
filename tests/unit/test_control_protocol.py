"""The control protocol typed both ways: every op has a request type, each reply reads
into a typed value, and a malformed reply is a ProtocolError, never a KeyError later."""

from __future__ import annotations

import pytest

from cryobox.errors import InvalidArgument, ProtocolError
from cryobox.models import SnapshotPurpose
from cryobox.sandbox.control import (
    REQUESTS,
    ControlOp,
    ExposePort,
    Kill,
    PortExposed,
    SetTimeout,
    Status,
    TakeSnapshot,
    TimeoutSet,
)
from cryobox.sandbox.registry import SandboxRecord
from cryobox.sandbox.state import SandboxState
from cryobox.sandbox.supervisor import Supervisor, encode_reply


def test_every_op_has_a_request_type_and_the_supervisor_a_handler() -> None:
    assert set(REQUESTS) == set(ControlOp)
    table = Supervisor._handlers(Supervisor.__new__(Supervisor))  # its methods, unbound state
    assert set(table) == set(ControlOp) - {ControlOp.START}  # START: the launcher's handshake
    for op, handler in table.items():
        assert handler.parse == REQUESTS[op].parse, op


def test_requests_round_trip_through_their_arguments() -> None:
    for request in (
        SetTimeout(5.0),
        ExposePort(8000),
        TakeSnapshot(SnapshotPurpose.FORK, "x", True),
    ):
        assert type(request).parse(request.to_args()) == request
    with pytest.raises(InvalidArgument, match="guest_port"):
        ExposePort.parse({"guest_port": 0})


def test_replies_read_into_typed_values() -> None:
    record = SandboxRecord(id="sbx-0123456789ab", state=SandboxState.RUNNING, ports={80: 8080})
    assert Status().read_reply(encode_reply(record)) == record
    assert SetTimeout(5).read_reply(encode_reply(TimeoutSet(12.5))) == TimeoutSet(12.5)
    assert ExposePort(80).read_reply(encode_reply(PortExposed(40000))) == PortExposed(40000)
    Kill().read_reply(encode_reply(None))  # nothing to read, nothing refused


@pytest.mark.parametrize(
    ("request_", "reply"),
    [
        (Status(), {"state": "no-such-state", "id": "x"}),
        (Status(), {}),
        (ExposePort(80), {"host_port": "8080"}),
        (ExposePort(80), {"host_port": 70000}),
        (SetTimeout(5), {"deadline": "soon"}),
        (Kill(), {"unexpected": 1}),
        (TakeSnapshot(SnapshotPurpose.SNAPSHOT, None, True), {"id": "x"}),
    ],
)
def test_a_malformed_reply_is_a_protocol_error(request_: object, reply: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        request_.read_reply(reply)  # type: ignore[attr-defined]
