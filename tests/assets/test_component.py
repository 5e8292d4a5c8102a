"""statetables as a component of a Dagster project of the user's own: a `dg` project whose only definitions are a
`defs.yaml` naming `statetables.StateTables`, loaded by Dagster's own command line, materialises a stream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

BIN = Path(sys.executable).parent

PYPROJECT = """\
[project]
name = "shop"
version = "0.1.0"

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "shop_pkg"
defs_module = "shop_pkg.defs"
"""
DEFINITIONS = """\
from pathlib import Path

import dagster as dg


@dg.definitions
def defs():
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
"""


@pytest.mark.long
def test_a_dagster_project_with_the_component_materialises_a_stream(tmp_path):
    project = tmp_path / "shop"
    (project / "shop_pkg/defs/lake").mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "shop_pkg/__init__.py").write_text("")
    (project / "shop_pkg/defs/__init__.py").write_text("")
    (project / "shop_pkg/definitions.py").write_text(DEFINITIONS)
    lake = tmp_path / "lake"
    (project / "shop_pkg/defs/lake/defs.yaml").write_text(
        f"type: statetables.StateTables\nattributes:\n  project: ../../../orders.yaml\n  storage_root: {lake}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATETABLES_")}
    env.update({"PYTHONPATH": str(project), "DAGSTER_HOME": str(tmp_path / "dagster_home")})
    (tmp_path / "dagster_home").mkdir()
    # The project file and a landing file, as `statetables init` writes them, under the component's storage root.
    init = subprocess.run([str(BIN / "statetables"), "init", str(tmp_path / "start")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert init.returncode == 0, init.stderr
    (tmp_path / "start/statetables.yaml").rename(project / "orders.yaml")
    (lake / "landing").mkdir(parents=True)
    (tmp_path / "start/data/landing/orders").rename(lake / "landing/orders")

    done = subprocess.run([str(BIN / "dagster"), "asset", "materialize", "-m", "shop_pkg.definitions",
                           "--select", "*"], cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = {r["region"]: (r["orders"], str(r["revenue"]))
            for r in DeltaTable(str(lake / "tables/orders_per_region")).to_pyarrow_table().to_pylist()}
    assert rows == {"north": (2, "32.25"), "south": (2, "52.50")}
    assert not (project / "data").exists()  # the component's storage root, not the working folder's
