"""A short soak (``make soak`` runs 30 minutes): every workload of it runs (a volume
mounted throughout, a rewind to an automatic checkpoint among them), a fault is
injected and recovered from, and nothing is lost (issue 31)."""

from __future__ import annotations

import pytest

from cryobox.bench import soak

pytestmark = pytest.mark.vm


def test_a_short_soak_loses_nothing() -> None:
    report = soak.run(1.0, server_faults_every=15, fork_every=3, checkpoint_every=8)
    summary = report.summary()
    assert report.losses == [], (report.losses, summary)
    assert report.pause_resume_cycles >= 5, summary
    assert report.rollback_cycles >= 1 and report.fork_cycles >= 1, summary
    assert report.rewind_cycles >= 1, summary
    assert report.copies_checked == 2 * report.fork_cycles, summary
    assert report.faults_injected >= 1, summary
    assert report.recoveries == report.faults_injected, summary
    assert report.api_requests > 10, summary
