from setuptools import find_packages, setup

# One resolvable, pinned stack. The Delta jars matching delta-spark come from Maven (`make jars`).
setup(
    name="statetables",
    version="0.1.0",
    description="Fault-tolerant streaming state tables on Spark + Delta Lake, orchestrated by Dagster.",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["pipelines", "pipelines.*", "assets", "resources", "statetables", "benchmarks"]),
    package_data={"pipelines.runtime": ["log4j2.properties"], "statetables": ["python-worker"]},
    install_requires=[
        "pyspark[connect]==4.1.1",  # [connect]: the Spark Connect client (grpcio, grpcio-status)
        "delta-spark==4.3.1",
        "dagster==1.13.27",
        "dagster-webserver==1.13.27",
        "dagster-pyspark==0.29.27",
        "pandas==2.3.3",  # the Spark Connect client needs it (pyspark[connect]); pinned for one resolvable stack
        "sqlglot==30.30.0",  # parses the project file's CREATE TABLE ... AS SELECT
        "PyYAML==6.0.4",  # reads the project file (dagster needs it too)
        "boto3==1.44.5",  # the S3 client of the storage layer (an s3a:// root) and of the writer's lease lock
        "confluent-kafka==2.16.1",  # the Kafka client (librdkafka) that creates topics and produces to a `make kafka` broker
        "deltalake==1.6.6",  # `statetables show`, `quarantine`, `explain`: tables read without a JVM (and the tests' reader)
        "pyarrow==22.0.0",  # delta-rs's answers as Arrow tables
    ],
    extras_require={
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "hypothesis==6.170.15",
                 "filelock==4.3.1",  # the engines test makes its reference tables once per session, across workers
                 "playwright==1.64.1"],  # the browser test drives Chromium with it (`make browser` installs one),
        # make bench: the one-machine alternative (d), memory sampling, the plot
        "bench": ["polars==2.1.0", "psutil==7.2.2", "matplotlib==3.11.2"],
    },
    entry_points={"console_scripts": ["statetables=statetables.cli:main"]},
)
