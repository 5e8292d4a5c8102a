"""Where everything lives under the storage root ($STATETABLES_HOME, default ./data).

    landing/<stream>/**/*.jsonl[.gz] input files (written once, `_`/`.` prefix while in flight)
    staging/<stream>/<unit>.jsonl    safe-named links to landing content (copies on S3; pipelines/ingest/landing.py)
    tables/<stream>_bronze           accepted events
    tables/<stream>_quarantine       malformed lines and conflicting duplicates, with reasons
    tables/<stream>_files            the ledger: every unit of landing content, with size, mtime, sha256
    tables/<state table>             movie_tickets_sold, payments_per_customer
    checkpoints/<query name>/        Structured Streaming checkpoints
    checkpoints/_set_aside/          checkpoints found untrusted, kept for inspection
    savepoints/<name>/               named snapshots: table versions + checkpoint copies
    locks/<writer>.lock              one writer per stream (kernel file locks; pipelines/runtime/locks.py)
    locks/<writer>.lease             the same on an object store: a lease renewed with conditional writes
    dagster/                         the Dagster instance (runs, schedules, sensors); always local

The root is a local folder or `s3a://bucket/prefix` (pipelines/storage/files.py): the same layout in both.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipelines.errors import ConfigurationError
from pipelines.storage.files import S3_SCHEME, AnyPath, S3Path

HOME_ENV = "STATETABLES_HOME"
DEFAULT_HOME = "data"


def _inside(root: AnyPath, path: AnyPath) -> bool:
    return path == root or root in path.parents


# Spark and Hadoop read these in a path as a URI scheme (`:`) or a glob pattern; tables and checkpoints
# live under the root, so it must not hold them (landing file names may: they are staged, see source.py).
UNSAFE_ROOT_CHARACTERS = ":[]{}*?"


def _root(raw: str) -> AnyPath:
    """The storage root: a local folder (a path or a `file://` URI), or an S3 bucket and prefix (`s3a://`).

    Without this, `s3a://bucket/x` would silently become the local folder `./s3a:/bucket/x`."""
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", raw)
    if scheme is None:
        return Path(raw).expanduser().resolve()
    name = scheme.group(1).lower()
    if name == "file":
        return Path(raw[len("file://"):] or "/").resolve()
    if name == S3_SCHEME:
        root = S3Path.parse(raw)
        bad = sorted({c for c in root.key if c in UNSAFE_ROOT_CHARACTERS})
        if bad:
            raise ConfigurationError(f"The storage root {raw} contains {' '.join(bad)}, which Spark and Hadoop paths "
                                     f"cannot hold. Fix: choose a prefix without any of {UNSAFE_ROOT_CHARACTERS}.")
        return root
    hint = " (Spark's S3 connector is s3a://: write s3a://bucket/prefix)" if name in ("s3", "s3n") else ""
    raise ConfigurationError(
        f"The storage root {raw} is on {name}://, which statetables does not support{hint}. Fix: set {HOME_ENV} "
        f"to a local folder, a shared POSIX mount at the same path on every host, or s3a://bucket/prefix "
        f"(docs/deploy.md)."
    )


def _require_usable_root(root: AnyPath) -> None:
    """Fail before anything is created if the storage root can never work."""
    if isinstance(root, S3Path):
        return  # the bucket is asked when a run starts (`storage.require_bucket`): loading code makes no request
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

    home: AnyPath
    landing_root: AnyPath
    tables_root: AnyPath
    checkpoints_root: AnyPath

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
        root = _root(raw)
        _require_usable_root(root)
        resolved = {}
        for name, sub in (("landing", landing), ("tables", tables), ("checkpoints", checkpoints)):
            if isinstance(root, S3Path) and str(sub).startswith("/"):
                raise ConfigurationError(f"The {name} folder {sub} is absolute, outside the storage root {root}. "
                                         f"Fix: give it relative to the root.")
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
        """Links under safe names to the landing content of `stream` (pipelines/ingest/landing.py)."""
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
    def on_object_store(self) -> bool:
        return isinstance(self.home, S3Path)

    @property
    def dagster_home(self) -> Path:
        """The Dagster instance (runs, schedules, sensors): SQLite files, so always on a local disk. With an object
        store root, `$DAGSTER_HOME`, or ./data/dagster."""
        if isinstance(self.home, S3Path):
            return Path(os.environ.get("DAGSTER_HOME") or Path(DEFAULT_HOME) / "dagster").resolve()
        return self.home / "dagster"
