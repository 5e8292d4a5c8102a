"""Where everything lives under the storage root ($STATETABLES_HOME, default ./data).

    landing/<stream>/**/*.jsonl[.gz] input files (written once, `_`/`.` prefix while in flight)
    staging/<stream>/<unit>.jsonl    safe-named links to landing content (pipelines/source.py)
    tables/<stream>_bronze           accepted events
    tables/<stream>_quarantine       malformed lines and conflicting duplicates, with reasons
    tables/<stream>_files            the ledger: every unit of landing content, with size, mtime, sha256
    tables/<state table>             movie_tickets_sold, payments_per_customer
    checkpoints/<query name>/        Structured Streaming checkpoints
    checkpoints/_set_aside/          checkpoints found untrusted, kept for inspection
    savepoints/<name>/               named snapshots: table versions + checkpoint copies
    locks/<writer>.lock              one writer per stream (kernel file locks)
    dagster/                         the Dagster instance (runs, schedules, sensors)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipelines.errors import ConfigurationError

HOME_ENV = "STATETABLES_HOME"
DEFAULT_HOME = "data"


def _inside(root: Path, path: Path) -> bool:
    return path == root or root in path.parents


# Spark and Hadoop read these in a path as a URI scheme (`:`) or a glob pattern; tables and checkpoints
# live under the root, so it must not hold them (landing file names may: they are staged, see source.py).
UNSAFE_ROOT_CHARACTERS = ":[]{}*?"


def _posix_root(raw: str) -> str:
    """The storage root as a POSIX path; `file://` URIs are accepted, object-store URIs refused.

    Without this, `s3a://bucket/x` would silently become the local folder `./s3a:/bucket/x`. And the
    one-writer guarantee rests on a kernel file lock under the root (pipelines/streaming.py
    `writer_lock`), which object stores do not have (docs/deploy.md)."""
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", raw)
    if scheme is None:
        return raw
    if scheme.group(1).lower() == "file":
        return raw[len("file://"):] or "/"
    raise ConfigurationError(
        f"The storage root {raw} is on {scheme.group(1)}://, which statetables does not support yet: its one-writer "
        f"lock and checkpoint checks need a POSIX file system, and on an object store two runs could advance a "
        f"stream at once. Fix: set {HOME_ENV} to a local folder, or to a shared POSIX mount (NFS) at the same path "
        f"on every host; docs/deploy.md says what an object-store root needs."
    )


def _require_usable_root(root: Path) -> None:
    """Fail before anything is created if the storage root can never work."""
    bad = sorted({c for c in str(root) if c in UNSAFE_ROOT_CHARACTERS})
    if bad:
        raise ConfigurationError(
            f"The storage root {root} contains {' '.join(bad)}, which Spark and Hadoop paths cannot hold. "
            f"Fix: set {HOME_ENV} to a folder whose path has none of {UNSAFE_ROOT_CHARACTERS}."
        )
    existing = root
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigurationError(
            f"The storage root {root} cannot be a folder: {existing} is a file. "
            f"Fix: set {HOME_ENV} to a folder (it is created if missing), e.g. {HOME_ENV}=./data."
        )


@dataclass(frozen=True)
class StorageLayout:
    """Absolute paths of every folder the project reads or writes.

    >>> layout = StorageLayout.under("/srv/statetables")
    >>> layout.table("movie_tickets_sold")
    PosixPath('/srv/statetables/tables/movie_tickets_sold')
    """

    home: Path
    landing_root: Path
    tables_root: Path
    checkpoints_root: Path

    @classmethod
    def under(
        cls,
        home: str | os.PathLike | None = None,
        *,
        landing: str = "landing",
        tables: str = "tables",
        checkpoints: str = "checkpoints",
    ) -> "StorageLayout":
        """Resolve the layout below `home` (default: $STATETABLES_HOME or ./data).

        Sub-folders may be relative (to home) or absolute, but must stay inside home:
        everything the project writes lives under one root that can be backed up or wiped.
        """
        raw = str(home or os.environ.get(HOME_ENV) or DEFAULT_HOME)
        root = Path(_posix_root(raw)).expanduser().resolve()
        _require_usable_root(root)
        resolved = {}
        for name, sub in (("landing", landing), ("tables", tables), ("checkpoints", checkpoints)):
            path = (root / sub).resolve()
            if not _inside(root, path):
                raise ConfigurationError(
                    f"The {name} folder {path} is outside the storage root {root}. "
                    f"Fix: give a path inside {root} (or relative to it), or move the root with "
                    f"{HOME_ENV}=<folder that contains it>."
                )
            resolved[name] = path
        return cls(
            home=root,
            landing_root=resolved["landing"],
            tables_root=resolved["tables"],
            checkpoints_root=resolved["checkpoints"],
        )

    def landing(self, stream: str) -> Path:
        return self.landing_root / stream

    def staging(self, stream: str) -> Path:
        """Links under safe names to the landing content of `stream` (pipelines/source.py)."""
        return self.home / "staging" / stream

    def table(self, name: str) -> Path:
        return self.tables_root / name

    def checkpoint(self, query_name: str) -> Path:
        return self.checkpoints_root / query_name

    @property
    def set_aside_checkpoints(self) -> Path:
        """Checkpoints that could not be trusted, moved here (not deleted) for inspection."""
        return self.checkpoints_root / "_set_aside"

    @property
    def locks(self) -> Path:
        return self.home / "locks"

    @property
    def savepoints(self) -> Path:
        return self.home / "savepoints"

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"
