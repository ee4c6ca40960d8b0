"""A VM that ended by itself gets a reason read from its console, never a blank."""

from __future__ import annotations

from pathlib import Path

from cryobox.sandbox.ending import guest_ending, vm_ended

PANIC = """[    3.1] Run /init as init process
[   41.923456] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000000
[   41.924000] CPU: 0 PID: 1 Comm: tini Not tainted 6.1.0-28-amd64
[   41.930000] ---[ end Kernel panic - not syncing: Attempted to kill init! ]---
"""


def test_a_panic_a_power_off_and_a_reboot_are_named() -> None:
    panicked = "the guest kernel panicked: Attempted to kill init! exitcode=0x00000000"
    assert guest_ending(PANIC) == panicked
    assert guest_ending("x\n[  9.5] reboot: Power down\n") == "the guest powered itself off"
    rebooted = guest_ending("reboot: Restarting system\r\n")
    assert rebooted is not None and rebooted.startswith("the guest rebooted itself")
    assert guest_ending("cryobox: guest agent exited with status 0, restarting\n") is None


def test_the_reason_keeps_qemus_words_and_is_never_blank(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    console.write_bytes(b"boot noise\n" * 20_000 + b"[ 1.0] reboot: Power down\n")
    assert (
        vm_ended("qemu", 0, "", console) == "the guest powered itself off (QEMU exited with code 0)"
    )
    assert vm_ended("qemu", 1, "oops\n", tmp_path / "none") == "QEMU exited with code 1: oops"
    silent = vm_ended("qemu", 0, "", tmp_path / "none")
    assert silent == "QEMU exited with code 0, and the guest's console says nothing of why"


def test_what_the_vmm_reported_wins_over_its_exit_code_but_not_over_a_panic(
    tmp_path: Path,
) -> None:
    console = tmp_path / "console.log"
    console.write_text("[ 11.2] sysrq: Power Off\n")
    off = "the guest powered itself off"
    assert vm_ended("qemu", -9, "", console, off) == off
    console.write_text(PANIC)
    assert vm_ended("qemu", 0, "", console, "the guest kernel panicked").endswith("0x00000000")


def test_a_vmm_killed_by_a_signal_is_named_by_it(tmp_path: Path) -> None:
    reason = vm_ended("qemu", -11, "", tmp_path / "none")
    assert reason.startswith("QEMU was killed by SIGSEGV (it crashed")
    assert vm_ended("qemu", -9, "", tmp_path / "none").startswith("QEMU was killed by SIGKILL")
