"""Start and stop the real Dagster webserver + daemon (`dagster dev`) on 127.0.0.1, for tests and scripts.

    with dagster_dev(StorageLayout.under("/tmp/st"), port=3111) as url:
        graphql(url, "{ version }")
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipelines.layout import HOME_ENV, StorageLayout
from statetables.cli import prepare_instance

REPO_ROOT = Path(__file__).resolve().parent.parent


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query, "variables": variables or {}})
                                     .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.loads(response.read())
    if body.get("errors"):
        raise RuntimeError(f"GraphQL errors: {body['errors']}")
    return body["data"]


@contextmanager
def dagster_dev(layout: StorageLayout, *, port: int, extra_env: dict[str, str] | None = None,
                log: Path | None = None, ready_timeout_s: float = 180) -> Iterator[str]:
    """`dagster dev` (webserver, daemon, code server) in its own process group; stopped on exit."""
    saved = os.environ.get("DAGSTER_HOME")
    os.environ.pop("DAGSTER_HOME", None)
    dagster_home = prepare_instance(layout)
    if saved is None:
        os.environ.pop("DAGSTER_HOME", None)
    else:
        os.environ["DAGSTER_HOME"] = saved
    env = {**os.environ, HOME_ENV: str(layout.home), "DAGSTER_HOME": str(dagster_home), **(extra_env or {})}
    url = f"http://127.0.0.1:{port}"
    out = open(log or layout.home / "dagster-dev.log", "ab")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-w", str(REPO_ROOT / "workspace.yaml"),
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {proc.returncode}; see {out.name}")
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dagster dev did not answer on {url} within {ready_timeout_s:.0f}s") from None
                time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        out.close()
