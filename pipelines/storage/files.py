"""The storage root's files, on a local folder or in an S3 bucket, through one small set of calls.

A local root is plain `pathlib.Path`. An `s3a://bucket/prefix` root is `S3Path`: the part of pathlib's API the
project uses (`/`, `name`, `parent`, `exists`, `iterdir`, `glob`, `read_text`, `write_text`, `unlink`, `stat`),
over boto3, talking to the bucket directly. Spark reads and writes the same paths through Hadoop's S3A
(`str(path)` is the `s3a://` URI). Hand-written because no maintained pathlib-for-S3 library gives the two things
the project needs from the store: the `s3a://` scheme Spark understands, and conditional writes (`If-None-Match`,
`If-Match`) for the writer lease (pipelines/runtime/locks.py).

What differs from a local folder, and how the callers cope:
- no symlinks: a landing file's content is staged by a server-side copy (`stage`);
- no atomic rename of a folder: `replace` copies every object, then deletes the originals (only untrusted
  checkpoints and abandoned savepoints are moved, under the stream's lock);
- folders are key prefixes: `mkdir` does nothing, and a folder exists when some key is under it.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Union

from pipelines.errors import ConfigurationError, StorageError

S3_SCHEME = "s3a"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"  # boto3 and the AWS CLI read it too
REGION_ENV = "AWS_REGION"
DEFAULT_REGION = "us-east-1"
IN_FLIGHT_PREFIXES = ("_", ".")  # files (and folders) still being written: skipped by `walk`


@dataclass(frozen=True)
class FileStat:
    st_size: int
    st_mtime_ns: int


_local = threading.local()


def s3_client():
    """This thread's boto3 S3 client, configured from the environment: credentials by boto3's own chain
    (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `~/.aws`, an instance role), `AWS_ENDPOINT_URL` for a store
    other than AWS (then path-style addressing, as S3-compatible servers expect), `AWS_REGION`."""
    key = (os.environ.get(ENDPOINT_ENV), os.environ.get(REGION_ENV), os.environ.get("AWS_ACCESS_KEY_ID"))
    cached = getattr(_local, "client", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    import boto3
    from botocore.config import Config

    endpoint = os.environ.get(ENDPOINT_ENV) or None
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=os.environ.get(REGION_ENV) or DEFAULT_REGION,
        config=Config(s3={"addressing_style": "path" if endpoint else "auto"}, connect_timeout=5, read_timeout=60,
                      retries={"mode": "standard", "max_attempts": 4}))
    _local.client = (key, client)
    return client


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def is_missing(exc: BaseException) -> bool:
    return _error_code(exc) in ("404", "NoSuchKey", "NotFound")


def is_precondition_failed(exc: BaseException) -> bool:
    return _error_code(exc) in ("412", "PreconditionFailed", "ConditionalRequestConflict", "409")


@dataclass(frozen=True)
class S3Path:
    """An object (or a key prefix: a folder) in a bucket. `str()` is the URI Spark reads: s3a://bucket/key."""

    bucket: str
    key: str = ""  # no leading or trailing '/'; "" is the bucket itself

    @classmethod
    def parse(cls, uri: str) -> "S3Path":
        match = re.match(r"^s3a://([^/]+)/?(.*)$", uri)
        if match is None:
            raise ConfigurationError(f"{uri} is not an s3a:// URI. Fix: write it as s3a://bucket/prefix.")
        return cls(match.group(1), _normal(match.group(2)))

    def __str__(self) -> str:
        return f"{S3_SCHEME}://{self.bucket}/{self.key}" if self.key else f"{S3_SCHEME}://{self.bucket}"

    def __truediv__(self, part: str | os.PathLike) -> "S3Path":
        part = str(part)
        if part.startswith("/"):
            raise ValueError(f"{part} is absolute: only relative parts go below {self}")
        return S3Path(self.bucket, _normal(posixpath.join(self.key, part)))

    def __lt__(self, other: "S3Path") -> bool:
        return str(self) < str(other)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def stem(self) -> str:
        return Path(self.name).stem

    @property
    def parent(self) -> "S3Path":
        return S3Path(self.bucket, posixpath.dirname(self.key))

    @property
    def parents(self) -> list["S3Path"]:
        found, path = [], self
        while path.key:
            path = path.parent
            found.append(path)
        return found

    def with_name(self, name: str) -> "S3Path":
        return self.parent / name

    def resolve(self) -> "S3Path":
        return self

    def expanduser(self) -> "S3Path":
        return self

    # --- reading ---------------------------------------------------------------------------------------------

    def _prefix(self) -> str:
        return f"{self.key}/" if self.key else ""

    def _list(self, *, delimiter: bool) -> Iterator[dict]:
        """ListObjectsV2 pages below this folder: {"Contents": [...], "CommonPrefixes": [...]}."""
        args = {"Bucket": self.bucket, "Prefix": self._prefix()}
        if delimiter:
            args["Delimiter"] = "/"
        yield from s3_client().get_paginator("list_objects_v2").paginate(**args)

    def stat(self) -> FileStat:
        try:
            head = s3_client().head_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if is_missing(exc):
                raise FileNotFoundError(str(self)) from exc
            raise
        return FileStat(head["ContentLength"], _mtime_ns(head["LastModified"]))

    def is_file(self) -> bool:
        if not self.key:
            return False
        try:
            self.stat()
        except FileNotFoundError:
            return False
        return True

    def is_dir(self) -> bool:
        page = s3_client().list_objects_v2(Bucket=self.bucket, Prefix=self._prefix(), MaxKeys=1)
        return page.get("KeyCount", 0) > 0

    def exists(self) -> bool:
        return self.is_dir() or self.is_file()

    def iterdir(self) -> Iterator["S3Path"]:
        prefix = self._prefix()
        for page in self._list(delimiter=True):
            for common in page.get("CommonPrefixes", []):
                yield S3Path(self.bucket, common["Prefix"].rstrip("/"))
            for item in page.get("Contents", []):
                if item["Key"] != prefix and not item["Key"].endswith("/"):  # a folder marker (Hadoop's mkdirs)
                    yield S3Path(self.bucket, item["Key"])

    def files(self) -> Iterator[tuple["S3Path", FileStat]]:
        """Every object below this folder, at any depth, with its size and modification time: one listing."""
        for page in self._list(delimiter=False):
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):
                    yield S3Path(self.bucket, item["Key"]), FileStat(item["Size"], _mtime_ns(item["LastModified"]))

    def glob(self, pattern: str) -> Iterator["S3Path"]:
        depth = pattern.count("/") + 1
        prefix = self._prefix()
        seen = set()
        for path, _ in self.files():
            relative = path.key[len(prefix):].split("/")
            if len(relative) >= depth:
                candidate = "/".join(relative[:depth])
                if candidate not in seen and fnmatch.fnmatchcase(candidate, pattern):
                    seen.add(candidate)
                    yield self / candidate

    def open(self, mode: str = "rb") -> IO[bytes]:
        if mode != "rb":
            raise ValueError("S3Path.open reads only ('rb'); write with write_bytes")
        try:
            return s3_client().get_object(Bucket=self.bucket, Key=self.key)["Body"]
        except Exception as exc:
            if is_missing(exc):
                raise FileNotFoundError(str(self)) from exc
            raise

    def read_bytes(self) -> bytes:
        with self.open() as body:
            return body.read()

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    # --- writing ---------------------------------------------------------------------------------------------

    def write_bytes(self, data: bytes) -> None:
        s3_client().put_object(Bucket=self.bucket, Key=self.key, Body=data)  # whole, or not at all

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Folders are key prefixes: nothing to create."""

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(str(self))
        s3_client().delete_object(Bucket=self.bucket, Key=self.key)

    def copy_to(self, target: "S3Path") -> None:
        s3_client().copy_object(Bucket=target.bucket, Key=target.key,
                                CopySource={"Bucket": self.bucket, "Key": self.key})


AnyPath = Union[Path, S3Path]


def _normal(key: str) -> str:
    parts = []
    for part in key.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/".join(parts)


def _mtime_ns(when) -> int:
    return int(when.timestamp() * 1_000_000) * 1000


def is_object_store(raw: str | os.PathLike | S3Path) -> bool:
    return isinstance(raw, S3Path) or str(raw).startswith(f"{S3_SCHEME}://")


def storage_path(raw: str | os.PathLike | S3Path) -> AnyPath:
    """The path object for a path or URI the project wrote: `S3Path` for s3a://, else `Path`."""
    if isinstance(raw, (Path, S3Path)):
        return raw
    raw = str(raw)
    return S3Path.parse(raw) if is_object_store(raw) else Path(raw)


def replace(source: AnyPath, target: AnyPath) -> None:
    """Move a file or a folder. Local: one atomic rename. S3: copy every object, then delete the originals."""
    if isinstance(source, Path):
        os.replace(source, target)
        return
    if source.is_file():
        source.copy_to(target)
        source.unlink(missing_ok=True)
        return
    moved = [path for path, _ in source.files()]
    for path in moved:
        path.copy_to(target / path.key[len(source.key) + 1:])
    for path in moved:
        path.unlink(missing_ok=True)


def write_atomic(path: AnyPath, data: bytes) -> None:
    """Readers see the whole content or none: a local file is written aside and renamed; an S3 PUT is whole."""
    if isinstance(path, S3Path):
        path.write_bytes(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def stage(source: str, target: AnyPath) -> None:
    """Make `target` (a safe name) read `source`'s content. Local: a symlink, made whole under its final name.
    S3: a server-side copy (no bytes pass through this process)."""
    if isinstance(target, S3Path):
        S3Path.parse(source).copy_to(target)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(source, tmp)
    os.replace(tmp, target)


def walk(folder: AnyPath) -> Iterator[tuple[AnyPath, FileStat]]:
    """Every file below `folder` at any depth, with its size and modification time; files and folders whose names
    start with `_` or `.` (still being written) are skipped. S3: one listing, no request per file."""
    if isinstance(folder, S3Path):
        prefix = folder._prefix()
        for path, stat in folder.files():
            if not any(part.startswith(IN_FLIGHT_PREFIXES) for part in path.key[len(prefix):].split("/")):
                yield path, stat
        return
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(IN_FLIGHT_PREFIXES))
        for name in sorted(names):
            if name.startswith(IN_FLIGHT_PREFIXES):
                continue
            path = Path(root) / name
            try:
                if not path.is_file():
                    continue
                stat = path.stat()
            except FileNotFoundError:  # renamed or deleted while scanning: the next scan sees it
                continue
            yield path, FileStat(stat.st_size, stat.st_mtime_ns)


def newest_commit(log: AnyPath, at_least: int) -> int | None:
    """The highest N with a commit file `<N:020d>.json` in the Delta log folder `log`, looking only at versions
    from `at_least` on; None when there is none from there (versions are contiguous: then `at_least` has none).
    A log keeps every commit for 30 days (Delta's log retention), 100,000s of files for a stream that commits every
    few seconds: listing it all cost 0.45 s a look at 100,000 commits on local disk, and a LIST page per 1,000 keys
    on S3. S3: one LIST that starts after the version's name. Local: a version's file is looked for by name,
    doubling the step, then halving it: a few `stat` calls however long the log."""
    if isinstance(log, S3Path):
        prefix = log._prefix()
        newest = None
        for page in s3_client().get_paginator("list_objects_v2").paginate(
                Bucket=log.bucket, Prefix=prefix, StartAfter=f"{prefix}{at_least:020d}"):
            for item in page.get("Contents", []):
                name = item["Key"][len(prefix):]
                if name.endswith(".json") and name[:-5].isdigit():
                    newest = max(newest or 0, int(name[:-5]))
        return newest

    def committed(version: int) -> bool:
        return (log / f"{version:020d}.json").exists()

    if not committed(at_least):
        return None
    low, step = at_least, 1  # low: committed
    while committed(low + step):
        low, step = low + step, step * 2
    high = low + step  # not committed: the newest lies in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if committed(middle) else (low, middle)
    return low


def require_bucket(root: S3Path) -> None:
    """Fail before any data is touched when the object store cannot be used, naming the fix."""
    endpoint = os.environ.get(ENDPOINT_ENV) or "AWS S3"
    try:
        s3_client().head_bucket(Bucket=root.bucket)
    except Exception as exc:  # botocore's errors: no credentials, no connection, 403, 404
        name = type(exc).__name__
        code = _error_code(exc)
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            problem, fix = "no credentials were found", ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a "
                                                         "profile in ~/.aws)")
        elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
            problem, fix = (f"the endpoint {endpoint} does not answer",
                            f"start the S3 server (`make s3-server` for the development one) or correct "
                            f"{ENDPOINT_ENV}")
        elif code in ("404", "NoSuchBucket", "NotFound"):
            problem, fix = (f"the bucket {root.bucket} does not exist at {endpoint}",
                            f"create it (`aws s3 mb s3://{root.bucket}`; `statetables s3-server --bucket "
                            f"{root.bucket}` creates it on the development server), or correct the bucket in the "
                            f"storage root")
        elif code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            problem, fix = (f"the store at {endpoint} refused the credentials ({code})",
                            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to a key that may read and write the "
                            "bucket")
        else:
            problem, fix = f"{name}: {exc}", f"check {ENDPOINT_ENV}, the credentials and the bucket"
        raise ConfigurationError(f"The storage root {root} cannot be used: {problem}; nothing was written. "
                                 f"Fix: {fix}.") from exc


def require_writable(path: S3Path) -> None:
    """A probe object written and deleted: the key may write below the root."""
    probe = path / f".statetables-write-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        probe.write_bytes(b"probe")
        probe.unlink(missing_ok=True)
    except Exception as exc:
        raise StorageError(f"Cannot write to {path}: {type(exc).__name__}: {exc}. Fix: give the key write access "
                           f"to the bucket, then run again; nothing was written.") from exc

