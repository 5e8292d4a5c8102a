"""A real S3-compatible server for the tests that need one: the project's own development server (s3proxy with a
filesystem backend, `statetables s3-server`), on a free port of 127.0.0.1, with the environment a user would set.

    with s3_store(tmp_path / "s3") as store:     # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... set meanwhile
        root = f"s3a://{store.bucket}/x"
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlparse

from statetables.servers import S3_DEV_ACCESS_KEY, S3_DEV_SECRET_KEY, _stop, free_port, s3_request_counts, s3_server

LEASE_S = "8"  # short, so that a killed holder's lease runs out within a test


@dataclass
class Store:
    endpoint: str
    bucket: str
    log: Path

    def listings(self, folder: str) -> list[dict[str, list[str]]]:
        """The query of every ListObjectsV2 whose prefix lies in a folder named `folder` (e.g. `_delta_log`), in the
        order served: the request log (`s3_store(log_requests=True)`)."""
        found = []
        for url in re.findall(r"\{GET@\w+ (http://\S+) HTTP", self.log.read_text(errors="replace")):
            query = parse_qs(urlparse(url).query)
            if "list-type" in query and f"/{folder}" in unquote(query.get("prefix", [""])[0]):
                found.append(query)
        return found

    def requests(self) -> dict[str, int]:
        """Requests the server has answered so far, by S3 operation (its metrics), e.g. {"PutObject": 120}."""
        counts: dict[str, int] = {}
        for (operation, _status), count in s3_request_counts(self.endpoint).items():
            counts[operation] = counts.get(operation, 0) + count
        return counts


@contextmanager
def s3_store(folder: Path, bucket: str = "statetables", lease_s: str = LEASE_S,
             log_requests: bool = False) -> Iterator[Store]:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "s3-server.log"
    proc = s3_server(port=port, data_dir=folder / "data", log=log, access_key=S3_DEV_ACCESS_KEY,
                     secret_key=S3_DEV_SECRET_KEY, bucket=bucket, log_requests=log_requests)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": S3_DEV_ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": S3_DEV_SECRET_KEY, "AWS_REGION": "us-east-1",
           "STATETABLES_LEASE_SECONDS": lease_s}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield Store(env["AWS_ENDPOINT_URL"], bucket, log)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _stop(proc)
