"""``make torture``: the multi-process torture of the store, the server's SQLite file and
a real PostgreSQL (each for TORTURE_SECONDS), with a line per target for
docs/BENCHMARKS.md. Exits non-zero when anything acknowledged was lost."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cryobox.bench import torture
from postgres_server import PostgresServer


def main() -> int:
    seconds = float(os.environ.get("TORTURE_SECONDS", "300"))
    folder = Path(tempfile.mkdtemp(prefix="cryobox-torture-"))
    postgres = PostgresServer()
    postgres.start()
    try:
        runs = [
            ("store (local packs + index)", "store", str(folder / "store")),
            ("server database (SQLite)", "database", str(folder / "server.db")),
            ("server database (PostgreSQL)", "database", postgres.create_database("torture")),
        ]
        reports: list[tuple[str, torture.Report]] = []
        for title, kind, target in runs:
            report = torture.run(kind, target, folder / f"logs-{kind}-{len(reports)}", seconds)
            reports.append((title, report))
            print(f"{title}: {report}", flush=True)
    finally:
        postgres.stop()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\n{when}, {os.cpu_count()} cores, {platform.node()}:\n")
    print("| target | minutes | processes started | kills -9 | acknowledged | lost | errors |")
    print("|---|---|---|---|---|---|---|")
    for title, r in reports:
        print(
            f"| {title} | {r.seconds / 60:.1f} | {r.processes} | {r.kills} | "
            f"{r.acknowledged:,} | {r.lost} | {len(r.errors)} |"
        )
    return 0 if all(r.ok for _, r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
