"""Measurements of cryobox on real VMs, never run by the tests' pass/fail: ``cryobox
bench`` (:mod:`.run` and its scenario modules), ``cryobox soak`` (:mod:`.soak`), the
multi-process torture of the store and databases (:mod:`.torture`), and the loopback S3
server they and the tests use (:mod:`.s3_server`)."""

#: Every ``cryobox bench`` scenario, in the order a full run takes them.
SCENARIOS = (
    "cold-boot",
    "diy",
    "exec",
    "ping",
    "guest-spawn",
    "template-start",
    "pause",
    "resume",
    "checkpoint",
    "rollback",
    "fork",
    "translation",
    "restore-vs-ram",
    "snapshot-bytes",
    "freed-memory",
    "history",
    "file-transfer",
    "volumes",
    "guest-flood",
    "http-exec",
    "http-get",
    "store",
    "cli-start",
    "shape",
)
