"""Wall time of `statetables run` (what `make run` does), as a user sees it: a new process, JVM start
included. Per repetition: a fresh storage root with N events per stream, then a second run over the
same (now empty of new files) landing folder. Prints each time and the medians.

    .venv/bin/python -m benchmarks.run_wall_time [--events 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def timed_run(home: Path) -> float:
    started = time.monotonic()
    subprocess.run([BIN / "statetables", "run"], env={**os.environ, "STATETABLES_HOME": str(home)},
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    loaded, empty = [], []
    for i in range(args.repeat):
        home = Path(tempfile.mkdtemp(prefix="statetables-bench-"))
        try:
            subprocess.run([BIN / "statetables", "generate", "--events", str(args.events), "--seed", str(i + 1)],
                           env={**os.environ, "STATETABLES_HOME": str(home)}, check=True, stdout=subprocess.DEVNULL)
            loaded.append(timed_run(home))
            empty.append(timed_run(home))
            print(f"repetition {i + 1}: {args.events} events/stream {loaded[-1]:.1f}s, no new files {empty[-1]:.1f}s",
                  flush=True)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    print(f"statetables run, {args.events} events per stream (2 streams): median {statistics.median(loaded):.1f}s "
          f"over {args.repeat}")
    print(f"statetables run, empty landing (no new files): median {statistics.median(empty):.1f}s over {args.repeat}")
    print(f"ratio loaded/empty: {statistics.median(loaded) / statistics.median(empty):.2f}")


if __name__ == "__main__":
    main()
