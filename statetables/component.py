"""statetables as a component of a Dagster project of your own (`dg` projects, Dagster 1.13 components).

    # <your project>/src/<package>/defs/lake/defs.yaml
    type: statetables.StateTables
    attributes:
      project: statetables.yaml      # relative to this defs.yaml's folder, or absolute
      storage_root: /data/lake       # optional: $STATETABLES_HOME otherwise (default ./data)

It adds every asset, check, job, schedule and sensor of that project file to the code location, as the standalone
`workspace.yaml` does. One StateTables component per code location: the assets read the project once per process.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from pipelines.declare.project import PROJECT_ENV
from pipelines.errors import ConfigurationError
from pipelines.storage.layout import HOME_ENV


class StateTables(dg.Component, dg.Model, dg.Resolvable):
    """The streams and tables of a statetables project file, as Dagster assets with their checks, jobs, schedules
    and sensors."""

    project: str = "statetables.yaml"
    storage_root: str | None = None

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        path = Path(self.project).expanduser()
        path = path if path.is_absolute() else (context.path / path)
        if not path.is_file():
            raise ConfigurationError(f"{context.path / 'defs.yaml'}: attributes.project {self.project}: no such file "
                                     f"({path}). Fix: name your statetables project file, relative to that folder "
                                     f"or absolute.")
        # In the environment, so that runs, which load this code location again, read the same project and root.
        os.environ[PROJECT_ENV] = str(path.resolve())
        if self.storage_root:
            os.environ[HOME_ENV] = self.storage_root
        from statetables.definitions import build_definitions

        return build_definitions()
