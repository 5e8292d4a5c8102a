# statetables — see README.md. Every target bootstraps what it needs, once.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
JARS := .jars/.resolved
CLASS_ARCHIVE := .jars/statetables.jsa
JVM_JAR := .jars/statetables-jvm.jar
JVM_SOURCES := $(wildcard jvm/src/statetables/jvm/*.java)
JARS_S3 := .jars/s3/.resolved
S3PROXY := .tools/s3proxy/.resolved
JARS_KAFKA := .jars/kafka/.resolved
KAFKA := .tools/kafka/.resolved
BROWSER := $(VENV)/.browser
FLINK := .venv-flink/.installed
export STATETABLES_HOME ?= $(CURDIR)/data

.PHONY: install jars jars-s3 s3proxy s3-server jars-kafka kafka kafka-broker flink class-archive browser ui-screenshots demo run dev serve connect-server cluster test test-long test-all bench bench-batch bench-core bench-history bench-quick bench-event-time bench-engines bench-freshness bench-object-store bench-full chaos chaos-s3 chaos-kafka clean

install: $(INSTALLED)
$(INSTALLED): setup.py
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 (or make PYTHON=/path/to/python3.11)"; exit 2; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	@touch $@

# Delta's jars, resolved once with Maven into .jars/, and the project's own JVM code (jvm/) compiled beside them;
# runs and tests load every jar there, offline, on every engine.
jars: $(JARS) $(JVM_JAR)
$(JARS): build/delta-jars.pom.xml
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (apt-get install maven) to fetch the Delta jars once"; exit 2; }
	@command -v java >/dev/null || { echo "java not found: install Java 17 (apt-get install openjdk-17-jdk-headless)"; exit 2; }
	rm -rf .jars && mkdir -p .jars
	# Spark already ships Hadoop, Parquet, Scala, Jackson, logging and compression: only Delta's own jars are copied.
	mvn -B -q -f build/delta-jars.pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.jars \
	  -DincludeScope=runtime \
	  -DexcludeGroupIds=org.apache.hadoop,org.apache.parquet,org.scala-lang,com.fasterxml.jackson.core,org.apache.logging.log4j,org.slf4j,org.xerial.snappy,com.github.luben,org.roaringbitmap,commons-logging,io.airlift,org.locationtech.jts,com.google.code.findbugs
	@touch $@

# The bench's peer case (h) only: PyFlink 2.3 in a virtualenv of its own (it pins its own pyarrow, pandas and Beam);
# `make bench-core` measures Flink's streaming job when it is there. Not part of install, demo or test.
flink: $(FLINK)
$(FLINK):
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 (or make PYTHON=/path/to/python3.11)"; exit 2; }
	@test -x .venv-flink/bin/python || $(PYTHON) -m venv .venv-flink
	.venv-flink/bin/pip install -q apache-flink==2.3.0
	@touch $@

# The object-store root (STATETABLES_HOME=s3a://bucket/prefix): hadoop-aws 3.4.2 (pyspark's Hadoop) and the AWS SDK v2
# modules it calls (build/s3-jars.pom.xml; ~10 MB, not the SDK's 641 MB bundle), into .jars/s3/, a subfolder that
# runs on local disk never load. Spark already ships netty, httpclient/httpcore, commons-* and slf4j: not copied.
jars-s3: $(JARS_S3)
$(JARS_S3): build/s3-jars.pom.xml
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (apt-get install maven) to fetch the S3 jars once"; exit 2; }
	rm -rf .jars/s3 && mkdir -p .jars/s3
	mvn -B -q -f build/s3-jars.pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.jars/s3 \
	  -DincludeScope=runtime \
	  -DexcludeGroupIds=io.netty,org.apache.httpcomponents,commons-logging,commons-codec,org.slf4j,org.wildfly.openssl,software.amazon.s3.analyticsaccelerator
	@touch $@

# s3proxy (build/s3proxy.pom.xml): a real S3 server over a local folder, for development and the object-store tests;
# its runtime jars into .tools/s3proxy/ once (~57 MB, its own JVM, never on Spark's classpath).
s3proxy: $(S3PROXY)
$(S3PROXY): build/s3proxy.pom.xml
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (apt-get install maven) to fetch s3proxy once"; exit 2; }
	@command -v java >/dev/null || { echo "java not found: install Java 17 (apt-get install openjdk-17-jdk-headless)"; exit 2; }
	rm -rf .tools/s3proxy && mkdir -p .tools/s3proxy
	mvn -B -q -f build/s3proxy.pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.tools/s3proxy -DincludeScope=runtime
	@touch $@

# Spark's Kafka source and sink (format("kafka")): spark-sql-kafka-0-10 4.1.1 and what pyspark/jars lacks of its runtime
# set (build/kafka-jars.pom.xml: the connector, its token provider, kafka-clients 3.9.1, commons-pool2; ~9.9 MB) into
# .jars/kafka/, which every engine loads when it is there. Hadoop's client, Scala, lz4, snappy, slf4j, jsr305 and
# spark-tags are pyspark's own: not copied (a second scala-library or slf4j-api would shadow Spark's).
jars-kafka: $(JARS_KAFKA)
$(JARS_KAFKA): build/kafka-jars.pom.xml
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (apt-get install maven) to fetch the Kafka jars once"; exit 2; }
	rm -rf .jars/kafka && mkdir -p .jars/kafka
	mvn -B -q -f build/kafka-jars.pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.jars/kafka \
	  -DincludeScope=runtime \
	  -DexcludeArtifactIds=hadoop-client-api,hadoop-client-runtime,scala-library,scala-parallel-collections_2.13,lz4-java,snappy-java,slf4j-api,jsr305,spark-tags_2.13
	@touch $@

# A real Kafka broker (build/kafka-broker.pom.xml): Apache Kafka 4.4.0's runtime jars and a logging binding into
# .tools/kafka/ once (~45 MB, its own JVM, never on Spark's classpath), for `make kafka-broker` and the Kafka tests.
kafka: $(KAFKA)
$(KAFKA): build/kafka-broker.pom.xml
	@command -v mvn >/dev/null || { echo "mvn not found: install Maven (apt-get install maven) to fetch Kafka once"; exit 2; }
	@command -v java >/dev/null || { echo "java not found: install Java 17 (apt-get install openjdk-17-jdk-headless)"; exit 2; }
	rm -rf .tools/kafka && mkdir -p .tools/kafka
	mvn -B -q -f build/kafka-broker.pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.tools/kafka -DincludeScope=runtime
	@touch $@

# jvm/: compiled with javac against the jars pyspark ships (Spark, Jackson); no dependency of its own.
$(JVM_JAR): $(JVM_SOURCES) $(JARS) $(INSTALLED)
	@command -v javac >/dev/null || { echo "javac not found: install a Java 17 JDK (apt-get install openjdk-17-jdk-headless)"; exit 2; }
	rm -rf .jars/jvm-classes && mkdir -p .jars/jvm-classes
	javac --release 17 -Xlint:all,-path -Werror -d .jars/jvm-classes \
	  -cp "$$($(BIN)/python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')/*" \
	  $(JVM_SOURCES)
	jar --create --file $@ -C .jars/jvm-classes .

# JVM class-data sharing: the classes a run loads, recorded once by a small pass of both streams;
# every later driver JVM maps them (pipelines/runtime/spark.py). Rebuilt when the jars or the install change.
class-archive: $(CLASS_ARCHIVE)
$(CLASS_ARCHIVE): $(JARS) $(JVM_JAR) $(INSTALLED)
	$(BIN)/python -m statetables.class_archive

# A headless Chromium for the browser test (tests/assets/test_ui.py), once: Debian's package where there is apt and
# root, otherwise the build Playwright downloads into its own cache.
browser: $(BROWSER)
$(BROWSER): $(INSTALLED)
	@if command -v chromium >/dev/null; then echo "browser: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
	else $(BIN)/playwright install chromium; fi
	@touch $@

demo: install jars class-archive
	$(BIN)/statetables generate --stream all --events 20000 --malformed 0.005 --duplicates 0.01 --late 0.02 --seed 1
	$(BIN)/statetables run --show

run: install jars class-archive
	$(BIN)/statetables run

# The Dagster UI + daemon beside a warm Spark Connect engine (127.0.0.1:15002) that every run uses and that is
# started again if it dies; Ctrl-C stops both. ENGINE=embedded: no engine, a JVM per run.
ENGINE ?= connect
ENGINE_FLAG = $(if $(filter embedded,$(ENGINE)),--embedded,--engine-port 15002)
dev: install jars class-archive
	$(BIN)/statetables dev --port 3000 $(ENGINE_FLAG)

# Always on: as `make dev`, with the continuous job running in the engine (assets/continuous.py); Ctrl-C cancels it.
serve: install jars class-archive
	$(BIN)/statetables serve --port 3000 $(ENGINE_FLAG)

# Other engines on 127.0.0.1 (docs/deploy.md): then `statetables run --remote sc://127.0.0.1:15002` or `--master spark://127.0.0.1:7077`.
connect-server: install jars
	$(BIN)/statetables connect-server --port 15002

cluster: install jars
	$(BIN)/statetables cluster --port 7077

# A local S3 server (s3proxy) on 127.0.0.1:9000 over ./s3data/, with the bucket `statetables`; prints the environment
# that points the product at it (STATETABLES_HOME=s3a://statetables/..., AWS_*). Ctrl-C stops it.
s3-server: install s3proxy
	$(BIN)/statetables s3-server --port 9000 --dir $(CURDIR)/s3data --bucket statetables

# A single-node Kafka broker (KRaft, broker and controller in one JVM) on 127.0.0.1:9092 over ./kafka-data/; prints the
# bootstrap address and the export that points a shell at it. Ctrl-C stops it; a restart keeps the topics.
kafka-broker: install kafka
	$(BIN)/statetables kafka-broker --port 9092 --dir $(CURDIR)/kafka-data

# Two workers, each with its own SparkSession: a single test keeps ~65% of the 2 cores busy (much of a
# small run is waiting on commits and query starts), two keep both busy. tests/conftest.py orders each worker's
# share longest first. The fast loop: every test but those marked `long`, 3 to 6 minutes on 2 cores by the day.
PYTEST := $(BIN)/pytest -q -n 2 --dist worksteal
test: install jars class-archive
	$(PYTEST) --durations=15 -m "not long" tests

# The rest: kill -9 chaos, the continuous job and the UI in headless Chromium under dagster dev, the same tables over
# Spark Connect and on a standalone cluster, lost, damaged or set-back checkpoints, a savepoint restore, the whole
# product on an s3a:// root (its own S3 server: the S3 connector and s3proxy are fetched for it), streams from Kafka
# topics (its own broker: Spark's Kafka connector and the broker's jars are fetched for it). 12 to 25 minutes.
test-long: install jars class-archive browser jars-s3 s3proxy jars-kafka kafka
	$(PYTEST) --durations=15 -m long tests

# Both tiers in one session (what .ci/run runs), 13 to 27 minutes on 2 cores: the long tests start first on both
# workers and the short ones fill in around them, so neither worker idles at the end of a tier; the summary gives
# each tier's test seconds.
test-all: install jars class-archive browser jars-s3 s3proxy jars-kafka kafka
	$(PYTEST) --durations=25 tests

# The browser test's screenshots of each step, into docs/ui/ (the README shows one).
ui-screenshots: install jars class-archive browser
	STATETABLES_UI_SHOTS=$(CURDIR)/docs/ui $(BIN)/pytest -q -p no:cacheprovider tests/assets/test_ui.py

# Side by side with the alternatives on the same files; writes docs/bench/ (see docs/performance.md).
bench: install jars class-archive jars-s3 s3proxy
	$(BIN)/python -m benchmarks.run --only batch
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.run --only object-store

# the 1M bulk run and a 10k increment with the root on local disk and in a bucket of the development S3 server,
# with the S3 requests per micro-batch (docs/bench/object_store.json)
bench-object-store: install jars class-archive jars-s3 s3proxy
	$(BIN)/python -m benchmarks.run --only object-store

bench-quick: install jars class-archive
	$(BIN)/python -m benchmarks.run --quick

# a micro-batch of 300 payments, warm and as a `statetables run` process: each step's seconds, Spark jobs and Delta
# commits, beside plain delta-spark's two appends and a MERGE of the same rows in the same process (docs/bench/batch.json)
bench-batch: install jars class-archive
	$(BIN)/python -m benchmarks.run --only batch

# the incremental and bulk targets alone: Spark's floor, the bulk run and its floor (every table it writes), +100k as a
# process, as its process and warm floors and warm, a full recompute; Flink's streaming job over the same 1M too after
# `make flink`
bench-core: install jars class-archive
	$(BIN)/python -m benchmarks.run --only core

# flat in history: +100k as a process and warm on 1M and on 5M of history (~25 min)
bench-history: install jars class-archive
	$(BIN)/python -m benchmarks.run --only history

# only case (g): the windowed and session tables' steps against the all-time step, 1M events of each stream
bench-event-time: install jars class-archive
	$(BIN)/python -m benchmarks.run --only paths

# `statetables run` on the embedded JVM, a warm Spark Connect server and a warm standalone cluster
bench-engines: install jars class-archive
	$(BIN)/python -m benchmarks.run --only engines

# freshness (landing file → state table, read with deltalake): continuous job against landing sensor + run
bench-freshness: install jars class-archive jars-kafka kafka
	$(BIN)/python -m benchmarks.run --only freshness
	$(BIN)/python -m benchmarks.run --only freshness-kafka

bench-full: install jars class-archive
	$(BIN)/python -m benchmarks.run --full

# kill -9 the real pipeline KILLS times (named fault points and random instants), then compare every key.
# Then CONTINUOUS_KILLS kills of the continuous job (run_continuously) while files land, then ENGINE_KILLS kills of a
# warm Spark Connect server while a run goes through it.
KILLS ?= 24
CONTINUOUS_KILLS ?= 4
ENGINE_KILLS ?= 4
chaos: install jars class-archive
	$(BIN)/python -m tests.chaos --kills $(KILLS) --continuous-kills $(CONTINUOUS_KILLS) --engine-kills $(ENGINE_KILLS)

# The same on an s3a:// root, in a bucket of the development S3 server that it starts (the writer lock is the lease)
chaos-s3: install jars class-archive jars-s3 s3proxy
	$(BIN)/python -m tests.chaos --object-store --kills $(KILLS) --continuous-kills $(CONTINUOUS_KILLS) --engine-kills $(ENGINE_KILLS)

# The same with both streams read from topics of a Kafka broker it starts, changelog topics published, and the broker
# restarted (every other time killed with SIGKILL) after every round
chaos-kafka: install jars class-archive jars-kafka kafka
	$(BIN)/python -m tests.chaos --kafka --kills $(KILLS) --continuous-kills $(CONTINUOUS_KILLS) --engine-kills $(ENGINE_KILLS)

clean:
	rm -rf data
