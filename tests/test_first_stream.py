"""The README's "Your first stream", walked as written: its commands, in a new folder, by the installed `statetables`
command, each one's output asserted. A new user's first hour: init, check, a run, show, quarantine, explain."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def readme_commands() -> list[str]:
    """The commands of the README's "Your first stream" after "Then, from any folder:", as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your first stream"):text.index("\n## ", text.index("## Your first stream") + 5)]
    block = re.search(r"Then, from any folder:\n\n```sh\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_first_stream_as_written(tmp_path):
    commands = readme_commands()
    assert [c.split()[:2] for c in commands] == [
        ["statetables", "init"], ["cd", "shop"], ["statetables", "check"], ["statetables", "run"],
        ["statetables", "show"], ["statetables", "quarantine"], ["statetables", "explain"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STATETABLES_", "DAGSTER_HOME"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    cwd, out, told = tmp_path, {}, {}
    for command in commands:
        words = shlex.split(command)
        if words[0] == "cd":
            cwd = cwd / words[1]
            continue
        done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stdout + done.stderr
        out[words[1]] = done.stdout
        told[words[1]] = done.stderr
    project = tmp_path / "shop" / "statetables.yaml"
    # Every command names the project it acts on, once (on stderr: stdout is the command's answer).
    for name, text in told.items():
        assert text.count(f"project: {project}") == 1, (name, text[:300])
    assert "statetables check" in out["init"] and (tmp_path / "shop/data/landing/orders/orders-0001.jsonl").is_file()
    assert "state table orders_per_region (line 14)" in out["check"]
    assert "MERGE INTO delta.`" in out["check"] and "ON t.`region` = s.`region`" in out["check"]
    assert "SUCCESS" in out["run"]
    rows = {line.split()[0]: line.split()[1:3] for line in out["show"].splitlines()
            if line.strip().startswith(("north", "south"))}
    # o-2 came twice and counts once; o-4's negative total is quarantined.
    assert rows == {"north": ["2", "32.25"], "south": ["2", "52.50"]}
    assert "orders_quarantine" in out["quarantine"] and '"order_id":"o-4"' in out["quarantine"]
    explained = out["explain"]
    events = explained[explained.index("== the accepted events"):explained.index("== lines that re-used")]
    assert "2 accepted events" in events and "o-1" in events and "o-3" in events and "o-2" not in events
    assert "orders-0001.jsonl" in events
    changes = explained[explained.index("== every commit that changed the row"):]
    assert "insert" in changes and "32.25" in changes
