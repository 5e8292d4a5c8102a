"""Named fault points for fault-injection runs (`make chaos`, the recovery tests).

Off unless $STATETABLES_FAULTS names a folder. A file in it named after a fault point arms that
point; its text says what happens there:

    kill                 kill -9 the whole process group (Python and the JVM) on the first hit
    kill hit=3           ... on the third hit in this process
    kill delay=0.4       arm a timer on the first hit that kills 0.4 s later (lands inside the
                         work that follows: a MERGE, Spark's checkpoint write)
    raise                raise InjectedFault (an ordinary failed run)
    poison TEXT          (ingest.poison_line only) every input line containing TEXT makes Spark fail
                         while evaluating it, on every run, as an engine bug tied to data would;
                         not consumed: the line stays poisonous until it is isolated

The file is deleted when the fault fires, so a fault fires once across processes: the run after
it (a recovery run, the next chaos round) goes through.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

FAULTS_ENV = "STATETABLES_FAULTS"

INGEST_AFTER_QUARANTINE_COMMIT = "ingest.after_quarantine_commit"
INGEST_AFTER_BRONZE_COMMIT = "ingest.after_bronze_commit"  # bronze committed, checkpoint not yet
STATE_MERGE_START = "state.merge_start"  # with delay=: dies inside the MERGE
STATE_AFTER_MERGE_COMMIT = "state.after_merge_commit"  # MERGE committed, checkpoint not yet
STATE_BATCH_END = "state.batch_end"
STATE_AFTER_REBUILD = "state.after_rebuild"  # a rebuild from bronze committed, before the query starts
INGEST_POISON = "ingest.poison_line"
# Between the commits of a windowed table's batch: late_events, its top N tables, its state, then the closing
# commit to the table.
WINDOWS_AFTER_LATE_COMMIT = "windows.after_late_commit"
WINDOWS_AFTER_TOP_COMMIT = "windows.after_top_commit"
WINDOWS_AFTER_STATE_COMMIT = "windows.after_state_commit"
WINDOWS_BEFORE_CLOSING_COMMIT = "windows.before_closing_commit"
# Between the commits of a session table's batch: late_events, its state, then the closing commit to the table.
SESSIONS_AFTER_LATE_COMMIT = "sessions.after_late_commit"
SESSIONS_AFTER_STATE_COMMIT = "sessions.after_state_commit"
SESSIONS_BEFORE_CLOSING_COMMIT = "sessions.before_closing_commit"
# After the last commit of a batch: foreachBatch returns, Spark then writes the commit file.
STREAM_BATCH_END = "stream.batch_end"
POINTS = (INGEST_AFTER_QUARANTINE_COMMIT, INGEST_AFTER_BRONZE_COMMIT, STATE_MERGE_START,
          STATE_AFTER_MERGE_COMMIT, STATE_BATCH_END, STATE_AFTER_REBUILD, INGEST_POISON,
          WINDOWS_AFTER_LATE_COMMIT, WINDOWS_AFTER_TOP_COMMIT, WINDOWS_AFTER_STATE_COMMIT,
          WINDOWS_BEFORE_CLOSING_COMMIT, SESSIONS_AFTER_LATE_COMMIT, SESSIONS_AFTER_STATE_COMMIT,
          SESSIONS_BEFORE_CLOSING_COMMIT, STREAM_BATCH_END)


class InjectedFault(RuntimeError):
    """Raised at an armed fault point whose action is `raise`."""


_hits: dict[str, int] = {}


def kill_process_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def fault_point(name: str) -> None:
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return
    armed = Path(folder) / name
    try:
        words = armed.read_text().split()
    except FileNotFoundError:
        return
    action = words[0] if words else "kill"
    options = dict(word.split("=", 1) for word in words[1:] if "=" in word)
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] < int(options.get("hit", "1")):
        return
    try:
        armed.unlink()
    except FileNotFoundError:
        return  # another process fired it first
    if action == "raise":
        raise InjectedFault(f"fault injected at {name}")
    delay = float(options.get("delay", "0"))
    if delay > 0:
        threading.Timer(delay, kill_process_group).start()
    else:
        kill_process_group()


def fault_marker(name: str) -> str | None:
    """The text an armed `poison` point names, without consuming it (None when not armed)."""
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return None
    try:
        words = (Path(folder) / name).read_text().split(maxsplit=1)
    except FileNotFoundError:
        return None
    return words[1].strip() if len(words) == 2 and words[0] == "poison" else None


def arm(folder: Path, name: str, action: str = "kill", **options: object) -> None:
    """Arm a fault point (used by the chaos harness and tests)."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(" ".join([action, *(f"{k}={v}" for k, v in options.items())]) + "\n")
