"""The host's egress CA is made once however many processes ask for it at once (the
supervisors of sandboxes starting together), and a process killed with -9 while making
it leaves one that loads: a certificate always names the key beside it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from cryobox.network import egress_ca

ASK = """
import sys
from cryobox.network import egress_ca
from cryptography.hazmat.primitives import serialization
authority = egress_ca.load()
key = authority.key.public_key().public_bytes(
    serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
)
print(authority.certificate_pem.strip().splitlines()[1], key.hex(), flush=True)
"""


def ask(folder: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "CRYOBOX_EGRESS_CA_DIR": str(folder)}
    return subprocess.Popen(
        [sys.executable, "-c", ASK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


def test_processes_asking_at_once_get_one_authority_and_a_kill_leaves_one_that_loads(
    tmp_path: Path,
) -> None:
    for round_ in range(4):
        folder = tmp_path / f"round-{round_}"
        askers = [ask(folder) for _ in range(6)]
        victims = random.sample(askers, 2)
        time.sleep(random.uniform(0.0, 0.6))  # somewhere in their imports or the making
        for victim in victims:
            victim.send_signal(signal.SIGKILL)
        answers = set()
        for asker in askers:
            out, err = asker.communicate(timeout=60)
            if asker in victims and asker.returncode == -signal.SIGKILL:
                continue
            assert asker.returncode == 0, err
            answers.add(out)
        # Every survivor saw the same certificate and key (made once, under the lock).
        assert len(answers) <= 1, answers
        # What is on disk loads, and its certificate names its key.
        authority = egress_ca.load(folder)
        public = authority.certificate.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        key = authority.key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert public == key
        if answers:
            line, key_hex = answers.pop().split()
            assert line in authority.certificate_pem and key_hex == key.hex()
        assert (folder / egress_ca.KEY).stat().st_mode & 0o077 == 0  # the key is private
