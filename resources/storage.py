"""Where data lives, as a Dagster resource: the one place that reads $STATETABLES_HOME."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from pipelines.storage.layout import StorageLayout


class StorageResource(dg.ConfigurableResource):
    """Storage root and its folders. Sub-folders must stay inside the root; anything else fails
    before a table is touched."""

    home: str | None = Field(default=None, description="Storage root; default $STATETABLES_HOME or ./data.")
    landing: str = Field(default="landing", description="Landing folder, relative to the root.")
    tables: str = Field(default="tables", description="Delta tables folder, relative to the root.")
    checkpoints: str = Field(default="checkpoints", description="Streaming checkpoints, relative to the root.")

    def layout(self) -> StorageLayout:
        return StorageLayout.under(self.home, landing=self.landing, tables=self.tables, checkpoints=self.checkpoints)
