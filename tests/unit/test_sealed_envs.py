"""A sandbox's variables (often API tokens) are sealed with the host key on disk, and
the E2B records keep none of them (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cryobox.sandbox.registry import SandboxDir, SandboxSpec
from cryobox.snapshot import keys
from specs import small_spec


def test_a_specs_variables_are_sealed_in_spec_json(tmp_path: Path) -> None:
    folder = SandboxDir(tmp_path / "sbx-1")
    spec = small_spec("sbx-1", envs={"API_TOKEN": "tok-9f8e7d"})
    folder.write_spec(spec)
    raw = folder.spec_file.read_text()
    assert "tok-9f8e7d" not in raw and "API_TOKEN" not in raw
    assert folder.spec() == spec
    # A spec written before sealing still reads; an altered seal is refused.
    old = json.loads(raw)
    old.pop("envs_sealed")
    assert SandboxSpec.from_json({**old, "envs": {"A": "b"}}).envs == {"A": "b"}
    sealed = keys.seal("envs", b'{"A": "b"}')
    with pytest.raises(ValueError, match="does not open"):
        keys.open_sealed("envs", sealed[:-4] + "AAAA")
    with pytest.raises(ValueError, match="does not open"):
        keys.open_sealed("other purpose", sealed)
