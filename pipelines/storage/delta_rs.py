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


# A file is read this many bytes at a time, a page after another: a dataset scan reads each column chunk whole, and a
# first load's session table (two files of ~490k rows, one row group each) raised the Python process by ~85 MB that
# way, against ~15 MB page by page (measured).
READ_BUFFER_BYTES = 1 << 20


def file_batches(dataset, columns: list[str], where=None, *, paths: set[str] | None = None,
                 batch_size: int = 16_384):
    """The rows of `dataset` (a delta-rs table's pyarrow dataset) matching `where` (a pyarrow dataset expression, or
    None: all), as record batches of `columns` typed as the dataset declares them, read file by file and page by
    page, so only a batch at a time is held. Files and row groups are skipped by their statistics (the log's and the
    file's). `paths`: only the files whose path ends with one of these (as a commit's `add` action names them,
    decoded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    declared = pa.schema([dataset.schema.field(c) for c in columns])
    for fragment in dataset.get_fragments(filter=where) if where is not None else dataset.get_fragments():
        if paths is not None and not any(fragment.path.endswith("/" + p) or fragment.path == p for p in paths):
            continue
        if where is not None:
            fragment = fragment.subset(filter=where)
            if not fragment.row_groups:
                continue
        with fragment.open() as handle:
            parquet = pq.ParquetFile(handle, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
            present = [c for c in columns if c in parquet.schema_arrow.names]
            for batch in parquet.iter_batches(batch_size=batch_size, columns=present, use_threads=False,
                                              row_groups=[g.id for g in fragment.row_groups]):
                # A column the file lacks (added to the table later) is NULL in it, as Delta reads it.
                batch = pa.record_batch([batch.column(c) if c in present else pa.nulls(batch.num_rows, f.type)
                                         for c, f in zip(columns, declared)], schema=pa.schema(
                    [batch.schema.field(c) if c in present else f for c, f in zip(columns, declared)])).cast(declared)
                yield batch.filter(where) if where is not None else batch
