"""One writer per stream: a kernel file lock on a local root, a lease object on an object-store root.

Dagster pools keep the daemon from launching two runs of a stream, but a run started by hand, from a second
instance or from another machine bypasses them. Delta's S3 log store is safe for one writer per table only (its
DynamoDB log store is not available here), so the project's own lock must hold across hosts.

Local root: `locks/<writer>.lock`, an exclusive `flock`. The kernel releases it when the holder dies, even by
kill -9, so a crash never leaves a stale lock.

Object-store root: `locks/<writer>.lease`, a small JSON object.
- Taken with a conditional PUT that succeeds only if the object is absent (`If-None-Match: *`), or, when the last
  holder released it or stopped renewing it, only if it is still the version this run read (`If-Match: <ETag>`):
  of two runs that try at once, exactly one wins.
- Renewed every third of its lifetime (`If-Match` on the ETag of the last renewal) by a thread of the holder.
- Expired when its holder dies: a waiter takes it over once the same ETag has stood for a whole lifetime by the
  waiter's own clock. No clocks are compared across hosts.
- Fencing: before each micro-batch's first commit, the batch reads the lease (`Fence`); if another run holds it,
  the batch raises `LeaseLostError` and commits nothing. A holder whose renewal finds another holder stops too.
- Released by writing it as released (not deleted), so it keeps naming the last holder, as the lock file does.
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
from typing import Iterator

from pipelines.errors import ConfigurationError, StreamBusyError
from pipelines.storage import AnyPath, S3Path, is_missing, is_precondition_failed, s3_client

LEASE_ENV = "STATETABLES_LEASE_SECONDS"
DEFAULT_LEASE_S = 60.0


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
    return locks_dir / (f"{writer}.lease" if isinstance(locks_dir, S3Path) else f"{writer}.lock")


def _since() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def lock_holder_line() -> str:
    """What the holder of a writer lock writes into the lock file: who holds it, for a run refused the lock and for
    `statetables status` (`lock_state`). The file keeps it after release: then it names the last holder."""
    return f"pid {os.getpid()} host {socket.gethostname()} since {_since()}\n"


_HOLDER = re.compile(r"^pid (?P<pid>\d+)(?: host (?P<host>\S+))? since (?P<since>\S+)$")


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
    the server's Python worker): the stream's lease must still be this run's. Picklable: a path and a token."""

    lease: str
    token: str

    def __call__(self) -> None:
        found = _read_lease(S3Path.parse(self.lease))
        body = found[1] if found else None
        if body is None or body.get("released") or body.get("token") != self.token:
            holder = "nobody" if body is None or body.get("released") else f"pid {body['pid']} on {body['host']}"
            raise LeaseLostError(
                f"This run no longer holds the writer lease {self.lease} (now: {holder}); it stopped before "
                f"committing this micro-batch, so nothing was written twice. It lost the lease by not renewing it "
                f"for a whole lifetime ({LEASE_ENV}). Fix: nothing to repair; the lease's holder advances the "
                f"stream, and the next run resumes from the last commit.")


@contextmanager
def writer_lock(locks_dir: AnyPath, writer: str, timeout_s: float) -> Iterator[Fence | None]:
    """Hold the exclusive writer lock of `writer`, waiting at most `timeout_s`. Yields the `Fence` that commits
    check on an object store (None on a local root: the kernel lock cannot be lost while its holder lives)."""
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
        handle.seek(0)
        handle.truncate()
        handle.write(lock_holder_line())
        handle.flush()
        yield None
    finally:
        handle.close()  # closing the descriptor releases the lock


def _busy(writer: str, path: AnyPath, holder: str, timeout_s: float) -> StreamBusyError:
    return StreamBusyError(f"Another run is advancing {writer} (lock {path} held by {holder}); waited "
                           f"{timeout_s:.0f}s. Nothing was written. Fix: let that run finish, then run again.")


# --- the lease ----------------------------------------------------------------------------------------------------

def _read_lease(path: S3Path) -> tuple[str, dict] | None:
    """(ETag, content) of the lease object, or None when there is none."""
    try:
        got = s3_client().get_object(Bucket=path.bucket, Key=path.key)
    except Exception as exc:
        if is_missing(exc):
            return None
        raise
    return got["ETag"], json.loads(got["Body"].read())


def _put(path: S3Path, body: dict, **condition: str) -> str:
    """A conditional PUT of the lease: its new ETag; raises on a failed precondition."""
    return s3_client().put_object(Bucket=path.bucket, Key=path.key, Body=json.dumps(body).encode(),
                                  ContentType="application/json", **condition)["ETag"]


def _holder_text(body: dict) -> str:
    return f"pid {body['pid']} host {body['host']} since {body['since']}"


class _Renewal(threading.Thread):
    def __init__(self, path: S3Path, body: dict, etag: str, ttl: float):
        super().__init__(name=f"lease-{path.name}", daemon=True)
        self.path, self.body, self.etag, self.ttl = path, body, etag, ttl
        self.stopping = threading.Event()
        self.lost: str | None = None
        self.renewed = time.monotonic()

    def run(self) -> None:
        while not self.stopping.wait(self.ttl / 3):
            try:
                self.etag = _put(self.path, {**self.body, "renewed_at": time.time()}, IfMatch=self.etag)
                self.renewed = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried until the lifetime runs out
                if is_precondition_failed(exc):
                    self.lost = "another run took the lease over"
                    return
                if time.monotonic() - self.renewed > self.ttl:
                    self.lost = f"no renewal succeeded for {self.ttl:.0f}s ({type(exc).__name__}: {exc})"
                    return


def _acquire_lease(path: S3Path, body: dict, timeout_s: float, ttl: float) -> str:
    """Take the lease; its ETag. Waits while another run renews it, takes it over once it stood still for a whole
    lifetime (its holder died) or was released."""
    deadline = time.monotonic() + timeout_s
    standing: tuple[str, float] | None = None  # (ETag seen, when first seen by this clock)
    while True:
        try:
            return _put(path, body, IfNoneMatch="*")
        except Exception as exc:
            if not is_precondition_failed(exc):
                raise
        found = _read_lease(path)
        if found is None:
            continue  # deleted by hand in between: create it again
        etag, current = found
        if standing is None or standing[0] != etag:
            standing = (etag, time.monotonic())
        stood = time.monotonic() - standing[1]
        if current.get("released") or stood >= float(current.get("ttl_s", ttl)):
            try:
                return _put(path, {**body, "took_over_from": None if current.get("released")
                                   else _holder_text(current)}, IfMatch=etag)
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
                continue  # another waiter won the race: see who holds it now
        if time.monotonic() >= deadline:
            raise _busy(body["writer"], path, _holder_text(current), timeout_s)
        time.sleep(min(1.0, ttl / 6))


@contextmanager
def _lease(path: S3Path, writer: str, timeout_s: float) -> Iterator[Fence]:
    ttl = lease_seconds()
    token = str(uuid.uuid4())
    body = {"writer": writer, "token": token, "pid": os.getpid(), "host": socket.gethostname(), "since": _since(),
            "renewed_at": time.time(), "ttl_s": ttl}
    etag = _acquire_lease(path, body, timeout_s, ttl)
    renewal = _Renewal(path, body, etag, ttl)
    renewal.start()
    try:
        yield Fence(str(path), token)
    finally:
        renewal.stopping.set()
        renewal.join()
        if renewal.lost is None:
            try:
                _put(path, {**body, "released": True, "renewed_at": time.time()}, IfMatch=renewal.etag)
            except Exception:  # noqa: BLE001 - lost in between, or the store is down: it expires by itself
                pass
