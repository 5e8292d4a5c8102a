"""Delta tables read in this process through delta-rs (`deltalake`), without a Spark job: small reads a run makes
before its query (the landing ledger), a small micro-batch's lookup of bronze's events of its ids
(pipelines/ingest/bronze.py), a table's size from its log's file statistics (`rows_and_max`) and the CLI's looks at
tables (`statetables show`). Only reads: every write goes through Spark (pipelines/storage/delta_sql.py), so one
engine decides what a commit holds."""

from __future__ import annotations

import os

from pipelines.storage.files import DEFAULT_REGION, ENDPOINT_ENV, REGION_ENV, AnyPath, S3Path


def storage_options(path: AnyPath) -> dict[str, str] | None:
    """delta-rs's options for an s3a:// path: the credentials boto3's chain finds (the environment, `~/.aws`, an
    instance role), as the storage layer's S3 client uses them, and the endpoint of the environment (plain HTTP
    when the endpoint is)."""
    if not isinstance(path, S3Path):
        return None
    import boto3

    options = {"AWS_REGION": os.environ.get(REGION_ENV) or DEFAULT_REGION}
    credentials = boto3.session.Session().get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        options.update({"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key,
                        **({"AWS_SESSION_TOKEN": frozen.token} if frozen.token else {})})
    endpoint = os.environ.get(ENDPOINT_ENV)
    if endpoint:
        options.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": str(endpoint.startswith("http:")).lower(),
                        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"})
    return options


def delta_table(path: AnyPath):
    """The Delta table at `path` (a local path or s3a://), or None when no table is there yet."""
    from deltalake import DeltaTable

    uri = str(path).replace("s3a://", "s3://", 1) if isinstance(path, S3Path) else str(path)
    options = storage_options(path)
    if not DeltaTable.is_deltatable(uri, storage_options=options):
        return None
    return DeltaTable(uri, storage_options=options)


def rows_and_max(path: AnyPath, column: str) -> tuple[int, int | None] | None:
    """The rows of the Delta table at `path` and the greatest value of its integer `column`, from the statistics
    every file's add action carries in the log: no data file is read and no Spark job runs. None when there is no
    table, or a file has no such statistics (written without them): then only reading the rows can tell."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = delta_table(path)
    if table is None:
        return None
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return 0, None
    newest, nulls, rows = f"max.{column}", f"null_count.{column}", files["num_records"]
    if newest not in files.column_names or nulls not in files.column_names:
        return None
    if rows.null_count or files[nulls].null_count:
        return None
    # A file whose column is all NULL has no maximum; any other without one was written without its statistics.
    if pc.any(pc.and_(pc.is_null(files[newest]), pc.not_equal(files[nulls], rows))).as_py():
        return None
    return pc.sum(rows).as_py(), pc.max(files[newest]).as_py()
