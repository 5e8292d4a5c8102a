"""One writer per stream: a kernel file lock on a local root, a lease object on an object-store root.

Dagster pools keep the daemon from launching two runs of a stream, but a run started by hand, from a second
instance or from another machine bypasses them. Delta's S3 log store is safe for one writer per table only (its
DynamoDB log store is not available here), so the project's own lock must hold across hosts.

Local root: `locks/<writer>.lock`, an exclusive `flock`. The kernel releases it when the holder dies, even by
kill -9, so a crash never leaves a stale lock. The holder writes a line naming itself and a token of its own; over
Spark Connect a micro-batch runs in the server's Python worker, which outlives a killed run, and its query goes on
planning batches until a later run's query takes its checkpoint: before each of its steps, a batch checks that the
line is still its run's (`LocalFence`, one read of the file), so a later holder's data is never folded by the dead
run's query too.

Object-store root: `locks/<writer>.lease/<generation>`, small JSON objects, one per holder, numbered 1, 2, 3, ...
The holder is the newest generation. Only one kind of conditional write is relied on: create-if-absent
(`If-None-Match: *`), which S3 and s3proxy make atomic (s3proxy's `If-Match` is checked, then written: measured
racy, so it is not used).
- Taken by creating the next generation: of two runs that try at once, exactly one creates it.
- Renewed every third of its lifetime by a thread of the holder, which rewrites its own generation (no one else
  writes it) and looks for a successor.
- Expired when its holder dies: a waiter creates the next generation once the holder's object has stood unchanged
  (same ETag) for a whole lifetime by the waiter's own clock. No clocks are compared across hosts.
- Fencing: before each step of a micro-batch, the batch asks whether its generation has a successor
  (`Fence`, one HEAD request); if so it raises `LeaseLostError` and commits nothing more. A holder whose renewal finds a
  successor, or that could not renew for a whole lifetime, is lost too.
- Released by rewriting its generation as released, so that it keeps naming the last holder, as the lock file
  does; the next run creates the next generation at once. Generations older than the previous one are deleted.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipelines.errors import ConfigurationError, StreamBusyError
from pipelines.storage.files import AnyPath, S3Path, is_missing, is_precondition_failed, s3_client

LEASE_ENV = "STATETABLES_LEASE_SECONDS"
DEFAULT_LEASE_S = 30.0


class LeaseLostError(RuntimeError):
    """Another run holds the stream's lease now: this run stopped before its next commit."""


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if value < 3:
        raise ConfigurationError(f"{LEASE_ENV}={raw!r}: the writer lease's lifetime must be a number of seconds "
                                 f">= 3. Fix: unset it (default {DEFAULT_LEASE_S:.0f}) or give e.g. 30.")
    return value


def lock_path(locks_dir: AnyPath, writer: str) -> AnyPath:
    """The lock file, or on an object store the folder of the lease's generations."""
    return locks_dir / (f"{writer}.lease" if isinstance(locks_dir, S3Path) else f"{writer}.lock")


def _since() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def lock_holder_line() -> str:
    """What the holder of a writer lock writes into the lock file: who holds it, for a run refused the lock and for
    `statetables status` (`lock_state`), and a token of this holding (`LocalFence`). The file keeps it after release:
    then it names the last holder."""
    return f"pid {os.getpid()} host {socket.gethostname()} since {_since()} token {uuid.uuid4().hex[:16]}\n"


_HOLDER = re.compile(r"^pid (?P<pid>\d+)(?: host (?P<host>\S+))? since (?P<since>\S+)(?: token \S+)?$")


def lock_state(locks_dir: AnyPath, writer: str) -> dict:
    """Whether `writer`'s lock is held now, and who holds it (or held it last): {"file", "held", "pid", "host",
    "since"}. Creates nothing."""
    path = lock_path(locks_dir, writer)
    state = {"file": str(path), "held": False, "pid": None, "host": None, "since": None}
    if isinstance(path, S3Path):
        lease = _read_lease(path)
        if lease is not None:
            body = lease[1]
            # Wall clocks compared here only to describe, never to take over (`_acquire_lease`).
            state.update(held=not body.get("released") and body["renewed_at"] + body["ttl_s"] > time.time(),
                         pid=body["pid"], host=body["host"], since=body["since"])
        return state
    # Asks the kernel with a shared lock taken and dropped at once, so it answers for holders on other hosts of an
    # NFS root too; a run that tries the lock in that instant tries again 0.5 s later, within its lock timeout.
    try:
        handle = open(path, "r", encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return state
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            state["held"] = True
        else:
            fcntl.flock(handle, fcntl.LOCK_UN)
        # Empty in the instant between a holder's flock and its write; a line of an older statetables has no host.
        holder = _HOLDER.match(handle.read().strip())
    if holder:
        state.update(pid=int(holder["pid"]), host=holder["host"], since=holder["since"])
    return state


@dataclass(frozen=True)
class Fence:
    """Checked by a micro-batch before its first commit, in whatever process runs the batch (over Spark Connect,
    the server's Python worker): the stream's lease must still be this run's, i.e. its generation must have no
    successor. One HEAD request. Picklable: the generation's URI and the holder's token."""

    lease: str
    token: str

    def __call__(self) -> None:
        lease = S3Path.parse(self.lease)
        successor = _successor(lease)
        if _exists(successor):
            found = _read(successor)
            holder = _holder_text(found[1]) if found else "a later run"
            raise LeaseLostError(
                f"This run no longer holds the writer lease {lease.parent} ({holder} took it over after this run "
                f"did not renew it for a whole lifetime, {LEASE_ENV}); it stopped before committing this "
                f"micro-batch, so nothing is written twice. Fix: nothing to repair; the lease's holder advances the "
                f"stream, and the next run resumes from the last commit.")


@dataclass(frozen=True)
class LocalFence:
    """`Fence` on a local root: the lock file must still hold this run's line (a later holder rewrites it). One read
    of the file, by whatever process runs the batch. Picklable: the file's path and the line."""

    path: str
    holder: str

    def __call__(self) -> None:
        try:
            found = Path(self.path).read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            found = ""
        if found != self.holder:
            raise LeaseLostError(
                f"This run no longer holds the writer lock {self.path} (it now names {found or 'no holder'}: the "
                f"run that started this query died, and another run took the stream); this micro-batch stopped "
                f"before its next commit, so nothing is written twice. Fix: nothing to repair; the lock's holder "
                f"advances the stream, and the next run resumes from the last commit.")


@contextmanager
def writer_lock(locks_dir: AnyPath, writer: str, timeout_s: float) -> Iterator[Fence | LocalFence]:
    """Hold the exclusive writer lock of `writer`, waiting at most `timeout_s`. Yields the fence a micro-batch
    checks before each of its steps: `Fence` on an object store, `LocalFence` on a local root."""
    if isinstance(locks_dir, S3Path):
        with _lease(lock_path(locks_dir, writer), writer, timeout_s) as fence:
            yield fence
        return
    locks_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(locks_dir, writer)
    handle = open(path, "a+")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise _busy(writer, path, holder, timeout_s) from None
                time.sleep(0.5)
        holder = lock_holder_line()
        handle.seek(0)
        handle.truncate()
        handle.write(holder)
        handle.flush()
        yield LocalFence(str(path), holder.strip())
    finally:
        handle.close()  # closing the descriptor releases the lock


def _busy(writer: str, path: AnyPath, holder: str, timeout_s: float) -> StreamBusyError:
    return StreamBusyError(f"Another run is advancing {writer} (lock {path} held by {holder}); waited "
                           f"{timeout_s:.0f}s. Nothing was written. Fix: let that run finish, then run again.")


# --- the lease ----------------------------------------------------------------------------------------------------

def _generation(path: S3Path) -> int:
    return int(path.name)


def _generations(folder: S3Path) -> list[S3Path]:
    return sorted((p for p in folder.iterdir() if p.name.isdigit()), key=_generation)


def _successor(lease: S3Path) -> S3Path:
    return lease.with_name(f"{_generation(lease) + 1:012d}")


def _read(path: S3Path) -> tuple[str, dict] | None:
    """(ETag, content) of a lease generation, or None when there is none."""
    try:
        got = s3_client().get_object(Bucket=path.bucket, Key=path.key)
    except Exception as exc:
        if is_missing(exc):
            return None
        raise
    return got["ETag"], json.loads(got["Body"].read())


def _read_lease(folder: S3Path) -> tuple[str, dict] | None:
    """(ETag, content) of the newest generation of a lease: its holder, or its last holder."""
    generations = _generations(folder)
    return _read(generations[-1]) if generations else None


def _put(path: S3Path, body: dict, **condition: str) -> str:
    return s3_client().put_object(Bucket=path.bucket, Key=path.key, Body=json.dumps(body).encode(),
                                  ContentType="application/json", **condition)["ETag"]


def _exists(path: S3Path) -> bool:
    try:
        s3_client().head_object(Bucket=path.bucket, Key=path.key)
    except Exception as exc:
        if is_missing(exc):
            return False
        raise
    return True


def _holder_text(body: dict) -> str:
    return f"pid {body['pid']} host {body['host']} since {body['since']}"


class _Renewal(threading.Thread):
    def __init__(self, lease: S3Path, body: dict, ttl: float):
        super().__init__(name=f"lease-{lease.parent.name}", daemon=True)
        self.lease, self.body, self.ttl = lease, body, ttl
        self.stopping = threading.Event()
        self.lost: str | None = None
        self.renewed = time.monotonic()

    def run(self) -> None:
        while not self.stopping.wait(self.ttl / 3):
            try:
                if _exists(_successor(self.lease)):
                    self.lost = "another run took the lease over"
                    return
                _put(self.lease, {**self.body, "renewed_at": time.time()})
                self.renewed = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried until the lifetime runs out
                if time.monotonic() - self.renewed > self.ttl:
                    self.lost = f"no renewal succeeded for {self.ttl:.0f}s ({type(exc).__name__}: {exc})"
                    return


def _acquire_lease(folder: S3Path, body: dict, timeout_s: float, ttl: float) -> S3Path:
    """Create the lease's next generation; its path. Waits while another run renews the newest one, goes past it
    once it stood still for a whole lifetime (its holder died) or was released."""
    deadline = time.monotonic() + timeout_s
    standing: tuple[str, str, float] | None = None  # (generation, ETag seen, when first seen by this clock)
    while True:
        generations = _generations(folder)
        newest = generations[-1] if generations else None
        current = _read(newest) if newest is not None else None
        if newest is not None and current is None:
            continue  # deleted in between
        if current is not None:
            etag, held = current
            if standing is None or standing[:2] != (newest.name, etag):
                standing = (newest.name, etag, time.monotonic())
            stood = time.monotonic() - standing[2]
            if not held.get("released") and stood < float(held.get("ttl_s", ttl)):
                if time.monotonic() >= deadline:
                    raise _busy(body["writer"], folder, _holder_text(held), timeout_s)
                time.sleep(min(1.0, ttl / 6))
                continue
        target = _successor(newest) if newest is not None else folder / f"{1:012d}"
        claim = {**body, "generation": _generation(target),
                 "took_over_from": None if current is None or current[1].get("released")
                 else _holder_text(current[1])}
        try:
            _put(target, claim, IfNoneMatch="*")
        except Exception as exc:
            if not is_precondition_failed(exc):
                raise
            continue  # another run created it first: see who holds it now
        for old in generations[:-1]:  # keep the previous holder's record; the rest is history
            old.unlink(missing_ok=True)
        return target


@contextmanager
def _lease(folder: S3Path, writer: str, timeout_s: float) -> Iterator[Fence]:
    ttl = lease_seconds()
    body = {"writer": writer, "token": str(uuid.uuid4()), "pid": os.getpid(), "host": socket.gethostname(),
            "since": _since(), "renewed_at": time.time(), "ttl_s": ttl}
    lease = _acquire_lease(folder, body, timeout_s, ttl)
    renewal = _Renewal(lease, body, ttl)
    renewal.start()
    try:
        yield Fence(str(lease), body["token"])
    finally:
        renewal.stopping.set()
        renewal.join()
        if renewal.lost is None:
            try:
                if not _exists(_successor(lease)):
                    _put(lease, {**body, "released": True, "renewed_at": time.time()})
            except Exception:  # noqa: BLE001 - the store is down: the lease expires by itself
                pass
