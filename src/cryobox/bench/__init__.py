"""Measurements of cryobox on real VMs, never run by the tests' pass/fail: ``cryobox
bench`` (:mod:`.run` and its scenario modules), ``cryobox soak`` (:mod:`.soak`), the
multi-process torture of the store and databases (:mod:`.torture`), and the loopback S3
server they and the tests use (:mod:`.s3_server`)."""
