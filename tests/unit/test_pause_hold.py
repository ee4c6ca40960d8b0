"""The pause hold's setting and request: bad values are named, never half-used."""

from __future__ import annotations

import math

import pytest

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.sandbox.control import ControlOp, Pause


def test_the_hold_comes_from_the_environment_and_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CRYOBOX_PAUSE_HOLD", raising=False)
    assert config.pause_hold() == config.PAUSE_HOLD == 60.0
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "0")
    assert config.pause_hold() == 0.0
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "2.5")
    assert config.pause_hold() == 2.5
    for bad in ("-1", "soon", "nan", "inf", "86401"):
        monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", bad)
        with pytest.raises(InvalidArgument, match="CRYOBOX_PAUSE_HOLD"):
            config.pause_hold()
        with pytest.raises(InvalidArgument, match="CRYOBOX_PAUSE_HOLD"):
            config.check_settings()  # what a resume or create checks first


def test_a_pause_request_carries_its_hold_and_refuses_anything_else() -> None:
    assert Pause.parse({}).hold == 0.0
    assert Pause.parse(Pause(30).to_args()).hold == 30.0
    for bad in (-1, True, "60", math.nan, math.inf, None):
        with pytest.raises(InvalidArgument, match=ControlOp.PAUSE.value):
            Pause.parse({"hold": bad})
