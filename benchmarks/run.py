"""`make bench`: this project side by side with the alternatives, on the same generated files, in one run.

    .venv/bin/python -m benchmarks.run [--quick | --full] [--repeat 3]

Every case runs as its own process (benchmarks/cases.py); each figure is the median of `--repeat`
runs. Whole-process wall time and peak resident memory (JVM and Python separately, sampled every
0.1 s over the process tree) are measured here; the time of the work inside the process is what the
case reports. Writes docs/bench/results.json, docs/bench/results.md (the table) and docs/bench/bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil

from benchmarks.cases import jvm_thread_cpu
from pipelines.runtime.spark import JARS_ENV, delta_jars

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OUT = ROOT / "docs" / "bench"
FLINK_PYTHON = ROOT / ".venv-flink" / "bin" / "python"  # `make flink`: the peer case (h)
INCREMENT_FILE_LINES = 100_000


def _sample_tree(pid: int, stop: threading.Event, peak: dict, cpu: dict) -> None:
    """Samples the process tree every 0.1 s until `stop`: its peak RSS into `peak`, and once a second the CPU seconds
    of its JVMs' threads by kind (`jvm_thread_cpu`) and of its Python processes into `cpu`, as last seen (a process's
    figures vanish with it)."""
    seen: dict[int, dict] = {}
    samples = 0
    while not stop.is_set():
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            jvm = py = 0
            for p in procs:
                try:
                    rss, name = p.memory_info().rss, p.name()
                    # Helpers a JVM spawns (jspawnhelper, shells) share its pages for an instant: counting them
                    # counted the JVM twice.
                    if name == "java":
                        jvm += rss
                        if samples % 10 == 0:
                            seen[p.pid] = jvm_thread_cpu(p)
                    elif name.startswith("python") or name in ("statetables", "dagster"):
                        py += rss
                        if samples % 10 == 0:
                            times = p.cpu_times()
                            seen[p.pid] = {"python": times.user + times.system}
                except psutil.Error:
                    pass
            peak["jvm"], peak["python"] = max(peak["jvm"], jvm), max(peak["python"], py)
            peak["total"] = max(peak["total"], jvm + py)
        except psutil.Error:
            pass
        samples += 1
        cpu.clear()
        for figures in seen.values():
            for kind, value in figures.items():
                cpu[kind] = round(cpu.get(kind, 0.0) + value, 1)
        stop.wait(0.1)


def delta_commits(home: Path) -> dict[str, int]:
    """Commits per table under `home` (files of each `_delta_log`, checkpoints left out)."""
    tables = home / "tables"
    return {t.name: len(list((t / "_delta_log").glob("*.json"))) for t in sorted(tables.iterdir())} \
        if tables.is_dir() else {}


def spark_jobs(event_log: Path) -> int:
    """The Spark jobs a process's JVM ran, from its event log."""
    return sum(line.startswith('{"Event":"SparkListenerJobStart"')
               for path in event_log.rglob("*") if path.is_file() for line in path.open(errors="replace"))


def counted(home: Path) -> dict:
    """Environment that makes the project's driver JVM write its event log under `home` (read by `counts`)."""
    log = home / "event-log"
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir(parents=True)
    return {"PYSPARK_SUBMIT_ARGS": f"--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=file:{log} "
                                   f"--conf spark.eventLog.compress=false pyspark-shell"}


def counts(home: Path, before: dict[str, int], stream: str = "payments") -> dict:
    """Spark jobs and Delta commits of a project run, in all and per micro-batch (a bronze commit each)."""
    after = delta_commits(home)
    commits = sum(after.values()) - sum(before.values())
    bronze = f"{stream}_bronze"
    # Each micro-batch appends to bronze once; a run that created bronze also wrote its creation commit.
    batches = after.get(bronze, 0) - before.get(bronze, 0) - (bronze not in before and bronze in after)
    jobs = spark_jobs(home / "event-log")
    return {"spark_jobs": jobs, "delta_commits": commits, "micro_batches": batches,
            "jobs_per_batch": round(jobs / batches, 1) if batches else None,
            "commits_per_batch": round(commits / batches, 1) if batches else None}


def measure(args: list[str], home: Path | None = None, env: dict | None = None) -> dict:
    """Run one process; its wall time, peak RSS and the RESULT line it printed. With `home` (a project run), also
    its Spark jobs and Delta commits (`counts`)."""
    before = delta_commits(home) if home else {}
    env = {**os.environ, **({"STATETABLES_HOME": str(home), **counted(home)} if home else {}), **(env or {})}
    peak, cpu = {"jvm": 0, "python": 0, "total": 0}, {}
    stop = threading.Event()
    started = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    sampler = threading.Thread(target=_sample_tree, args=(proc.pid, stop, peak, cpu), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    result = next((json.loads(line[7:]) for line in reversed(stdout.splitlines()) if line.startswith("RESULT ")), {})
    if home and "runs" not in result:  # a case of several runs counts each itself
        result.update(counts(home, before))
    return {"wall_s": wall, "peak_rss_mb": {k: round(v / 2**20) for k, v in peak.items()}, "process_cpu_s": cpu,
            **result}


def case(name: str, **options) -> list[str]:
    args = [str(BIN / "python"), "-m", "benchmarks.cases", name]
    for key, value in options.items():
        for item in value if isinstance(value, list) else [value]:
            args += [f"--{key}", str(item)]
    return args


def project_run(home: Path) -> list[str]:
    return [str(BIN / "statetables"), "run", "--job", "advance_payments", "--log-level", "WARNING"]


# Event time: every history ends before HISTORY_ENDS_AGO; increments follow from INCREMENTS_START_AGO on, one after
# another in a home, and the last ends in the past (a chain of six 100k increments spans 6.9 days).
HISTORY_ENDS_AGO = timedelta(days=8)
INCREMENTS_START_AGO = timedelta(days=7.9)


class Data:
    """Generated landing files, made once per run and hard-linked into each case's folder."""

    def __init__(self, root: Path, file_lines: int):
        self.root, self.file_lines = root, file_lines

    def history(self, events: int) -> Path:
        from pipelines.ingest.generate import generate
        from pipelines.declare.project import stream_spec
        folder = self.root / f"history-{events}"
        if not folder.is_dir():
            # Ends before HISTORY_ENDS_AGO whatever the size (its steps average 15 s): the increments follow it.
            start = datetime.now(timezone.utc) - timedelta(seconds=15.5 * events) - HISTORY_ENDS_AGO
            generate(stream_spec("payments"), folder, events=events, seed=1, events_per_file=self.file_lines, start=start,
                     customers=max(2000, events // 10))
        return folder

    def well_formed(self, folder: Path) -> Path:
        """A copy of `folder` holding only the lines that are JSON objects (for (d), which cannot skip the others)."""
        target = folder.with_name(folder.name + "-well-formed")
        if not target.is_dir():
            target.mkdir()
            for path in sorted(folder.glob("*.jsonl")):
                kept = []
                for line in path.read_bytes().splitlines():
                    try:
                        if isinstance(json.loads(line), dict):
                            kept.append(line)
                    except ValueError:
                        pass
                (target / path.name).write_bytes(b"\n".join(kept) + b"\n")
        return target

    def sales_history(self, events: int) -> Path:
        from pipelines.ingest.generate import generate
        from pipelines.declare.project import stream_spec
        folder = self.root / f"sales-history-{events}"
        if not folder.is_dir():
            start = datetime.now(timezone.utc) - timedelta(seconds=15.5 * events, days=5)
            generate(stream_spec("movie_ticket_sales"), folder, events=events, seed=2, events_per_file=self.file_lines, start=start)
        return folder

    def increment(self, events: int, seed: int, customers: int, after_s: int = 0) -> Path:
        """`events` new payments 1 s apart (a day or so of traffic), starting `after_s` seconds after
        INCREMENTS_START_AGO (past every history's end): a home that gets several increments gets each after the one
        before (`after_s` the events it already got), as the next day's traffic comes. Increments over the same hours
        would be behind the watermark the first one moved: late events, which no session or window folds."""
        from pipelines.ingest.generate import generate
        from pipelines.declare.project import stream_spec
        folder = self.root / (f"increment-{events}-{seed}-{customers}" + (f"-after-{after_s}" if after_s else ""))
        if not folder.is_dir():
            start = datetime.now(timezone.utc) - INCREMENTS_START_AGO + timedelta(seconds=after_s)
            generate(stream_spec("payments"), folder, events=events, seed=100 + seed, events_per_file=min(events, INCREMENT_FILE_LINES),
                     start=start, customers=customers, max_step_s=2)
        return folder


def link_into(source: Path, landing: Path, prefix: str = "") -> None:
    landing.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.jsonl")):
        os.link(path, landing / f"{prefix}{path.name}")


def table_files(home: Path) -> dict:
    tables = {}
    for table in sorted((home / "tables").iterdir()) if (home / "tables").is_dir() else []:
        data = [p for p in table.rglob("*.parquet") if "_delta_log" not in p.parts]
        log = list((table / "_delta_log").glob("*"))
        tables[table.name] = {"data_files": len(data), "data_mb": round(sum(p.stat().st_size for p in data) / 2**20, 1),
                              "log_files": len(log)}
    return tables


def median(runs: list[dict], key: str = "wall_s") -> float:
    return round(statistics.median(r.get(key, r["wall_s"]) for r in runs), 2)


def record_case(results: dict, key: str, runs: list[dict]) -> None:
    results["cases"][key] = {"runs": runs, "wall_s": median(runs), "work_s": median(runs, "work_s"),
                             "peak_rss_mb": max(r["peak_rss_mb"]["total"] for r in runs),
                             "peak_rss_jvm_mb": max(r["peak_rss_mb"]["jvm"] for r in runs),
                             "peak_rss_python_mb": max(r["peak_rss_mb"]["python"] for r in runs)}
    c = results["cases"][key]
    if runs[-1].get("micro_batches"):
        c.update({k: runs[-1][k] for k in ("spark_jobs", "delta_commits", "micro_batches", "jobs_per_batch",
                                            "commits_per_batch")})
    per_batch = f"  jobs/batch {c['jobs_per_batch']}  commits/batch {c['commits_per_batch']}" if "micro_batches" in c \
        else ""
    # Where a whole process's CPU went (the median run's): on 2 busy cores, the JIT's share is time the work lost.
    middle = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2].get("process_cpu_s") or {}
    if middle.get("jvm"):
        c["process_cpu_s"] = middle
        per_batch += "  cpu-s " + " ".join(f"{k} {v}" for k, v in middle.items())
    print(f"{key:45s} wall {c['wall_s']:8.2f}s  work {c['work_s']:8.2f}s  peak {c['peak_rss_mb']:6d} MB{per_batch}",
          flush=True)


def bench(sizes: list[int], increments: list[int], repeat: int, work: Path) -> dict:
    data = Data(work / "data", min(INCREMENT_FILE_LINES, max(sizes) // 10 or 1))
    results: dict = {"cases": {}}
    record = partial(record_case, results)

    small = work / "small_table"
    if not small.is_dir():
        import pyarrow as pa
        from deltalake import write_deltalake
        write_deltalake(str(small), pa.table({"id": list(range(10))}))
    # (e) with the class archive (what every run here starts with) and without it, in turn.
    without = work / "jars-without-class-archive"
    if not without.is_dir():
        without.mkdir()
        for jar in delta_jars():
            (without / jar.name).symlink_to(jar)
    # Measured inside every repetition, among the other cases: measured only first, (e) once took longer
    # than (a)'s whole 1M process later in the same run (the machine's load drifts over a run).
    minimal, bare = [], []

    for size in sizes:
        history = data.history(size)
        runs = {k: [] for k in ("a", "b", "c", "d", "f")}
        for rep in range(repeat):
            minimal.append(measure(case("minimal", out=small)))
            bare.append(measure(case("minimal", out=small), env={JARS_ENV: str(without)}))
            runs["a"].append(measure(case("floor", landing=history, out=work / f"floor-{size}-{rep}")))
            home = work / f"home-{size}-{rep}"
            link_into(history, home / "landing" / "payments")
            runs["f"].append(measure(project_run(home), home))
            runs["b"].append(measure(case("recompute", home=home, out=work / f"recompute-{size}-{rep}")))
            runs["c"].append(measure(case("stateful", landing=history, out=str(work / f"stateful-{size}-{rep}"))))
            runs["d"].append(measure(case("polars", landing=data.well_formed(history),
                                          out=work / f"polars-{size}-{rep}")))
        record("e_minimal_spark_delta_process", minimal)
        record("e_minimal_without_class_archive", bare)
        for key, label in (("a", "a_spark_floor"), ("b", "b_full_recompute"), ("c", "c_spark_stateful_rocksdb"),
                           ("d", "d_polars_deltalake"), ("f", "f_statetables_run")):
            record(f"{label}@{size}", runs[key])
        event_time_paths(data, size, repeat, work, record, results)
        history_home = work / f"home-{size}-0"
        record(f"f_statetables_run_no_new_files@{size}", [measure(project_run(history_home), history_home)
                                                         for _ in range(repeat)])
        history_got_s = 0  # the event time of the increments history_home got so far
        for inc in increments:
            customers = max(2000, size // 10)
            # whole process, on empty history and on this history (which grows by each increment)
            for base, label in ((None, "0"), (history_home, str(size))):
                process_runs = []
                for rep in range(repeat):
                    folder = data.increment(inc, seed=rep, customers=customers,
                                            after_s=0 if base is None else history_got_s)
                    history_got_s += 0 if base is None else inc
                    home = base or work / f"inc-{inc}-{rep}"
                    link_into(folder, home / "landing" / "payments", prefix=f"p{rep}-{label}-")
                    process_runs.append(measure(project_run(home), home))
                record(f"f_increment_{inc}_process@history_{label}", process_runs)
                warm_home = base or work / f"warm-{inc}"
                (warm_home / "landing" / "payments").mkdir(parents=True, exist_ok=True)
                got_s = 0 if base is None else history_got_s
                folders = [data.increment(inc, seed=10 + rep, customers=customers, after_s=got_s + rep * inc)
                           for rep in range(repeat)]
                history_got_s += 0 if base is None else repeat * inc
                warm = measure(case("warm", home=warm_home, increment=folders), warm_home)
                steps = [{"wall_s": r["run_s"], "work_s": r["run_s"], "peak_rss_mb": warm["peak_rss_mb"], **r}
                         for r in warm["runs"]]
                record(f"f_increment_{inc}_warm_run@history_{label}", steps)
            recompute_runs = [measure(case("recompute", home=history_home, out=work / f"recompute-inc-{inc}-{rep}"))
                              for rep in range(repeat)]
            record(f"b_full_recompute_after_increments@{size}", recompute_runs)
        results.setdefault("table_files", {})[f"history_{size}_after_increments"] = table_files(history_home)
    return results


def event_time_paths(data: Data, size: int, repeat: int, work: Path, record, results: dict) -> None:
    """(g) the event-time paths against the all-time path, on the same `size`-event bronze of each stream."""
    paths = []
    for rep in range(repeat):
        home = work / f"paths-{size}-{rep}"
        link_into(data.history(size), home / "landing" / "payments")
        link_into(data.sales_history(size), home / "landing" / "movie_ticket_sales")
        paths.append(measure(case("paths", home=home), home))
    record(f"g_event_time_paths@{size}", paths)
    results["cases"][f"g_event_time_paths@{size}"]["steps"] = {
        stream: {key: statistics.median(r[stream][key] for r in paths) for key in paths[0][stream]
                 if isinstance(paths[0][stream][key], (int, float))}
        for stream in ("movie_ticket_sales", "payments")}


def event_time_ratios(results: dict, size: int) -> dict:
    out = {}
    for stream, g in results["cases"][f"g_event_time_paths@{size}"]["steps"].items():
        out[f"{stream}@{size}: event-time step / all-time step, same bronze"] = g["event_time_s"] / g["all_time_s"]
        out[f"{stream}@{size}: event-time step, events/s"] = g["event_time_events_per_s"]
        out[f"{stream}@{size}: all-time step, events/s"] = g["all_time_events_per_s"]
        out[f"{stream}@{size}: event-time operator state, MB"] = (g.get("operator_state_bytes") or 0) / 2**20
    return out


def ratios(results: dict, sizes: list[int], increments: list[int]) -> dict:
    c = {k: v["wall_s"] for k, v in results["cases"].items()}
    work = {k: v["work_s"] for k, v in results["cases"].items()}
    minimal = c["e_minimal_spark_delta_process"]
    out = {"smallest process (e): with the class archive / without": minimal / c["e_minimal_without_class_archive"]}
    for size in sizes:
        f = c[f"f_statetables_run@{size}"]
        out[f"run@{size} / spark floor (a), whole process"] = f / c[f"a_spark_floor@{size}"]
        out[f"run@{size} / full recompute (b), whole process"] = f / c[f"b_full_recompute@{size}"]
        out[f"run@{size} / spark stateful (c), whole process"] = f / c[f"c_spark_stateful_rocksdb@{size}"]
        out[f"run@{size} / polars + delta-rs (d), whole process"] = f / c[f"d_polars_deltalake@{size}"]
        out[f"run@{size} / smallest spark+delta process (e)"] = f / minimal
        out[f"no new files@{size} / smallest process (e) [target <= 1.5]"] = c[f"f_statetables_run_no_new_files@{size}"] / minimal
        out[f"bulk events/s, run@{size} (whole process)"] = size / f
        out[f"bulk events/s, spark floor (a)@{size} (job inside)"] = size / work[f"a_spark_floor@{size}"]
        out.update(event_time_ratios(results, size))
        for inc in increments:
            empty = c[f"f_increment_{inc}_process@history_0"]
            full = c[f"f_increment_{inc}_process@history_{size}"]
            out[f"increment {inc}: history {size} / empty history, whole process [target <= 1.3]"] = full / empty
            warm_empty, warm_full = c[f"f_increment_{inc}_warm_run@history_0"], c[f"f_increment_{inc}_warm_run@history_{size}"]
            out[f"increment {inc}: history {size} / empty history, warm run [target <= 1.3]"] = warm_full / warm_empty
            out[f"increment {inc} / smallest process (e), whole process"] = empty / minimal
            out[f"full recompute (b)@{size} / increment {inc} warm run [target >= 10]"] = (
                c[f"b_full_recompute_after_increments@{size}"] / warm_full)
            out[f"events/s, increment {inc} warm run on history {size}"] = inc / warm_full
    return {k: round(v, 2) for k, v in out.items()}


def plot(results: dict, sizes: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = results["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    size = sizes[-1]
    labels = ["a_spark_floor", "b_full_recompute", "c_spark_stateful_rocksdb", "d_polars_deltalake", "f_statetables_run"]
    names = ["(a) Spark floor", "(b) full recompute", "(c) Spark stateful", "(d) Polars+delta-rs", "(f) statetables"]
    walls = [cases[f"{k}@{size}"]["wall_s"] for k in labels]
    works = [cases[f"{k}@{size}"]["work_s"] for k in labels]
    x = range(len(labels))
    axes[0].bar([i - 0.2 for i in x], walls, 0.4, label="whole process")
    axes[0].bar([i + 0.2 for i in x], works, 0.4, label="work inside")
    axes[0].axhline(cases["e_minimal_spark_delta_process"]["wall_s"], color="grey", ls="--",
                    label="(e) smallest Spark+Delta process")
    axes[0].set_xticks(list(x), names, rotation=20, fontsize=8)
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_title(f"{size:,} payment events, bulk")
    axes[0].legend(fontsize=8)
    incs = sorted({int(k.split("_")[2]) for k in cases if k.startswith("f_increment_")})
    for j, history in enumerate(["0", str(size)]):
        vals = [cases[f"f_increment_{i}_warm_run@history_{history}"]["wall_s"] for i in incs]
        procs = [cases[f"f_increment_{i}_process@history_{history}"]["wall_s"] for i in incs]
        axes[1].plot([str(i) for i in incs], vals, marker="o", label=f"warm run, history {int(history):,}")
        axes[1].plot([str(i) for i in incs], procs, marker="s", ls=":", label=f"whole process, history {int(history):,}")
    axes[1].axhline(cases[f"b_full_recompute_after_increments@{size}"]["wall_s"], color="red", ls="--",
                    label=f"(b) full recompute at {size:,}")
    axes[1].set_xlabel("new events in the run")
    axes[1].set_ylabel("seconds (median)")
    axes[1].set_title("increments: cost follows new data?")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: dict) -> str:
    lines = ["| case | whole process s | work inside s | peak RSS MB (JVM + Python) | micro-batches | Spark jobs "
             "per batch | Delta commits per batch |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, c in results["cases"].items():
        lines.append(f"| {key} | {c['wall_s']:.2f} | {c['work_s']:.2f} | {c['peak_rss_mb']} "
                     f"({c['peak_rss_jvm_mb']} + {c['peak_rss_python_mb']}) | {c.get('micro_batches', '')} | "
                     f"{c.get('jobs_per_batch', '')} | {c.get('commits_per_batch', '')} |")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in results["ratios"].items()]
    for name, tables in results.get("table_files", {}).items():
        lines += ["", f"Files per table, {name}:", "", "| table | data files | data MB | log files |", "|---|---:|---:|---:|"]
        lines += [f"| {t} | {v['data_files']} | {v['data_mb']} | {v['log_files']} |" for t, v in tables.items()]
    return "\n".join(lines) + "\n"


def only_core(repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    """The incremental and bulk targets on payments, medians of `repeat`: Spark's floor (a), the bulk `statetables
    run` and the bulk's floor (`floor_bulk`: every table the run writes, plain delta-spark) over the history; then on
    that history, +increment as a whole `statetables run`, as its process floor (`floor_increment`), as its warm
    floors (`floor_increment_warm`: its two commits; `floor_increment_warm_every_table`: every table) and as warm
    runs; then (a) and the full recompute (b) over history + increment.
    Prints each case with its jobs and commits per micro-batch and the ratios; writes docs/bench/core.json."""
    size, inc = (20_000, 5_000) if quick else (1_000_000, 100_000)
    data = Data(work / "data", min(INCREMENT_FILE_LINES, size // 10))
    results: dict = {"cases": {}}
    record = partial(record_case, results)
    history = data.history(size)
    record("validation_jvm_vs_sql", [measure(case("validation", landing=history)) for _ in range(repeat)])
    floor, bulk, floor_bulk = [], [], []
    for rep in range(repeat):
        floor.append(measure(case("floor", landing=history, out=work / f"floor-{rep}")))
        home = work / f"home-{rep}"
        link_into(history, home / "landing" / "payments")
        bulk.append(measure(project_run(home), home))
        floor_bulk.append(measure(case("floor_bulk", landing=history, out=work / f"floor-bulk-{rep}")))
        shutil.rmtree(work / f"floor-bulk-{rep}", ignore_errors=True)
    record(f"a_spark_floor@{size}", floor)
    record(f"f_statetables_run@{size}", bulk)
    record(f"floor_bulk_every_table@{size}", floor_bulk)
    if FLINK_PYTHON.exists():  # the peer (h), after `make flink`
        record(f"h_flink_streaming@{size}", [measure([str(FLINK_PYTHON), str(Path(__file__).parent / "flink_peer.py"),
                                                       "--landing", str(history)]) for _ in range(repeat)])
    else:
        print("(h) Flink's streaming job not measured: `make flink` installs PyFlink for it")
    # +inc, whole process, each on its own copy of the history's home (rep's), then the whole 1.1M from scratch
    plus, floor_plus, floor_all, recompute = [], [], [], []
    for rep in range(repeat):
        home = work / f"home-{rep}"
        folder = data.increment(inc, seed=rep, customers=max(2000, size // 10))
        # The increment's process floor, on a copy of the state table the run starts from.
        floor_out = work / f"floor-increment-{rep}"
        shutil.copytree(home / "tables" / "payments_per_customer", floor_out / "state")
        floor_plus.append(measure(case("floor_increment", landing=folder, out=floor_out)))
        link_into(folder, home / "landing" / "payments", prefix="inc-")
        plus.append(measure(project_run(home), home))
        everything = work / f"all-{rep}"
        link_into(history, everything)
        link_into(folder, everything, prefix="inc-")
        floor_all.append(measure(case("floor", landing=everything, out=work / f"floor-all-{rep}")))
        recompute.append(measure(case("recompute", home=home, out=work / f"recompute-{rep}")))
    record(f"f_increment_{inc}_process@history_{size}", plus)
    record(f"floor_increment_{inc}_process@history_{size}", floor_plus)
    record(f"a_spark_floor@{size + inc}", floor_all)
    record(f"b_full_recompute@{size + inc}", recompute)
    warm_home = work / "home-0"  # which got the first +inc above: the warm increments follow it
    folders = [data.increment(inc, seed=10 + rep, customers=max(2000, size // 10), after_s=(1 + rep) * inc)
               for rep in range(repeat)]
    # The warm floor first, from the state table the warm runs start from.
    floor_warm = measure(case("floor_increment_warm", home=warm_home, out=work / "floor-increment-warm",
                              increment=folders, repeat=repeat))
    record(f"floor_increment_{inc}_warm@history_{size}",
           [{"wall_s": r["work_s"], "peak_rss_mb": floor_warm["peak_rss_mb"], **r} for r in floor_warm["runs"]])
    floor_every = measure(case("floor_increment_warm_every_table", home=warm_home,
                               out=work / "floor-increment-warm-every-table", increment=folders, repeat=repeat))
    # The contract names every table but the changelog copy (the state tables' change feed is their change log).
    record(f"floor_increment_{inc}_warm_every_table@history_{size}",
           [{"wall_s": r["work_s"], "peak_rss_mb": floor_every["peak_rss_mb"],
             "without_changelog_s": r["work_s"] - r["changelog_s"],
             "without_changelog_or_dedup_s": r["work_s"] - r["changelog_s"] - r["dedup_s"], **r}
            for r in floor_every["runs"]])
    warm = measure(case("warm", home=warm_home, increment=folders), warm_home)
    record(f"f_increment_{inc}_warm_run@history_{size}",
           [{"wall_s": r["run_s"], "work_s": r["run_s"], "peak_rss_mb": warm["peak_rss_mb"], **r} for r in warm["runs"]])
    c = {k: v["wall_s"] for k, v in results["cases"].items()}
    results["ratios"] = {k: round(v, 2) for k, v in {
        f"bulk run@{size} / spark floor (a)@{size}, whole process [target <= 3]":
            c[f"f_statetables_run@{size}"] / c[f"a_spark_floor@{size}"],
        f"bulk floor (every table the run writes, plain delta-spark)@{size} / spark floor (a)@{size}, whole process "
        f"[above 3: target 3 is below the stack's floor]":
            c[f"floor_bulk_every_table@{size}"] / c[f"a_spark_floor@{size}"],
        f"bulk run@{size} / its floor (every table, plain delta-spark), whole process":
            c[f"f_statetables_run@{size}"] / c[f"floor_bulk_every_table@{size}"],
        f"warm +{inc} run / full recompute (b)@{size + inc}, whole process [target <= 0.5]":
            c[f"f_increment_{inc}_warm_run@history_{size}"] / c[f"b_full_recompute@{size + inc}"],
        f"+{inc} `statetables run` / spark floor (a)@{size + inc}, whole process [target <= 1]":
            c[f"f_increment_{inc}_process@history_{size}"] / c[f"a_spark_floor@{size + inc}"],
        f"+{inc} process floor (append + MERGE, plain delta-spark) / spark floor (a)@{size + inc}, whole process "
        f"[above 1: target 1 is below the stack's floor]":
            c[f"floor_increment_{inc}_process@history_{size}"] / c[f"a_spark_floor@{size + inc}"],
        f"+{inc} `statetables run` / its process floor, whole process":
            c[f"f_increment_{inc}_process@history_{size}"] / c[f"floor_increment_{inc}_process@history_{size}"],
        f"warm +{inc} floor of its two commits (append + MERGE, plain delta-spark, warm) / full recompute "
        f"(b)@{size + inc}":
            c[f"floor_increment_{inc}_warm@history_{size}"] / c[f"b_full_recompute@{size + inc}"],
        f"warm +{inc} run / the floor of its two commits":
            c[f"f_increment_{inc}_warm_run@history_{size}"] / c[f"floor_increment_{inc}_warm@history_{size}"],
        f"warm +{inc} floor of every table, the changelog copy included (plain delta-spark, warm) / full recompute "
        f"(b)@{size + inc}":
            c[f"floor_increment_{inc}_warm_every_table@history_{size}"] / c[f"b_full_recompute@{size + inc}"],
        f"warm +{inc} floor of the tables the contract names (every table but the changelog copy, with the "
        f"contract's dedup against history, plain delta-spark, warm) / full recompute (b)@{size + inc} [above 0.5: "
        f"target 0.5 is below the stack's floor]":
            median(results["cases"][f"floor_increment_{inc}_warm_every_table@history_{size}"]["runs"],
                   "without_changelog_s") / c[f"b_full_recompute@{size + inc}"],
        f"warm +{inc} floor of those tables without the dedup against history / full recompute (b)@{size + inc}":
            median(results["cases"][f"floor_increment_{inc}_warm_every_table@history_{size}"]["runs"],
                   "without_changelog_or_dedup_s") / c[f"b_full_recompute@{size + inc}"],
        f"warm +{inc} run (no changelog copy: published off the runs) / the floor of the tables the contract names":
            c[f"f_increment_{inc}_warm_run@history_{size}"]
            / median(results["cases"][f"floor_increment_{inc}_warm_every_table@history_{size}"]["runs"],
                     "without_changelog_s"),
        f"events/s, warm +{inc} run": inc / c[f"f_increment_{inc}_warm_run@history_{size}"],
        **({f"bulk run@{size} / Flink's streaming job (h)@{size}, whole process [target <= 1.5]":
            c[f"f_statetables_run@{size}"] / c[f"h_flink_streaming@{size}"],
            f"bulk floor (every table, plain delta-spark)@{size} / Flink's streaming job (h)@{size}, whole process "
            f"[above 1.5: target 1.5 is below the stack's floor]":
            c[f"floor_bulk_every_table@{size}"] / c[f"h_flink_streaming@{size}"]}
           if f"h_flink_streaming@{size}" in c else {}),
        f"validation of {size} lines, SQL / JVM (same process)": median(results["cases"]["validation_jvm_vs_sql"]["runs"],
                                                                        "sql_s") / median(
            results["cases"]["validation_jvm_vs_sql"]["runs"], "jvm_s"),
    }.items()}
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "repeat": repeat, "size": size, "increment": inc}
    print(markdown(results))
    target = OUT if not quick else work
    (target / "core.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {target}/core.json")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def only_history(repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    """Flat in history: the same increment on a history 5 times as large, as a whole `statetables run` and warm,
    medians of `repeat`. Each history is loaded once by a `statetables run` (timed, one run), with a tenth as many
    customers as events, as `only_core`'s; each increment comes from customers of its history and lands on top of
    the ones before it. Writes docs/bench/history.json."""
    sizes, inc = ((20_000, 100_000), 5_000) if quick else ((1_000_000, 5_000_000), 100_000)
    data = Data(work / "data", min(INCREMENT_FILE_LINES, sizes[0] // 10))
    results: dict = {"cases": {}}
    record = partial(record_case, results)
    for size in sizes:
        home = work / f"home-{size}"
        link_into(data.history(size), home / "landing" / "payments")
        record(f"f_statetables_run@{size}", [measure(project_run(home), home)])
        plus = []
        for rep in range(repeat):
            link_into(data.increment(inc, seed=rep, customers=max(2000, size // 10), after_s=rep * inc),
                      home / "landing" / "payments", prefix=f"inc-{size}-")
            plus.append(measure(project_run(home), home))
        record(f"f_increment_{inc}_process@history_{size}", plus)
        folders = [data.increment(inc, seed=10 + rep, customers=max(2000, size // 10), after_s=(repeat + rep) * inc)
                   for rep in range(repeat)]
        warm = measure(case("warm", home=home, increment=folders), home)
        record(f"f_increment_{inc}_warm_run@history_{size}",
               [{"wall_s": r["run_s"], "work_s": r["run_s"], "peak_rss_mb": warm["peak_rss_mb"], **r}
                for r in warm["runs"]])
    c = {k: v["wall_s"] for k, v in results["cases"].items()}
    small, large = sizes
    results["ratios"] = {k: round(v, 2) for k, v in {
        f"+{inc} `statetables run` on history {large} / on history {small}, whole process [target <= 1.2]":
            c[f"f_increment_{inc}_process@history_{large}"] / c[f"f_increment_{inc}_process@history_{small}"],
        f"warm +{inc} run on history {large} / on history {small} [target <= 1.2]":
            c[f"f_increment_{inc}_warm_run@history_{large}"] / c[f"f_increment_{inc}_warm_run@history_{small}"],
    }.items()}
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "repeat": repeat, "sizes": sizes, "increment": inc}
    print(markdown(results))
    print(json.dumps(results["ratios"], indent=1))
    target = OUT if not quick else work
    (target / "history.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {target}/history.json")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


# The warm micro-batch's measured rounds: a median of 3 moved by a tenth of a second from one run to the next, and
# every table writes a Delta checkpoint at its 10th commit (its round ~60% more Spark jobs): 9 rounds after the
# warm-up reach that commit and keep it one of nine.
WARM_ROUNDS = 9


def only_batch(repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    """A micro-batch of 300 payments: warm (one process, `batch` case, WARM_ROUNDS measured rounds: each step's
    seconds, Spark jobs and Delta commits, beside plain delta-spark's two appends and a MERGE of the same rows), and
    as a whole `statetables run` process (medians of `repeat`: a new storage root, then 300 more on it) beside a
    process of plain delta-spark doing the same commits (`floor_batch`). Writes docs/bench/batch.json."""
    from pipelines.declare.project import stream_spec
    from pipelines.ingest.generate import generate
    started = time.monotonic()
    events = 300
    home = work / "warm"
    warm = measure(case("batch", home=home, events=events, repeat=max(repeat, WARM_ROUNDS)), env={
        "STATETABLES_HOME": str(home), **counted(home)})
    processes: dict[str, list] = {"process_run_new_root": [], "process_run_300_more": [], "process_floor": []}
    for rep in range(repeat):
        home = work / f"process-{rep}"
        for part, seed in (("process_run_new_root", 2 * rep), ("process_run_300_more", 2 * rep + 1)):
            folder = work / f"generated-{rep}-{seed}"
            generate(stream_spec("payments"), folder, events=events, seed=seed, customers=100, events_per_file=events,
                     start=datetime.now(timezone.utc) - timedelta(days=2, hours=-seed), max_step_s=2)
            link_into(folder, home / "landing" / "payments", prefix=f"{seed}-")
            processes[part].append(measure(project_run(home), home))
        # The stack's own floor, in turn with the runs: a process that starts Spark and commits the same 300 rows as
        # two appends and a MERGE into tables that exist (the second file: the first made them).
        for seed in (2 * rep, 2 * rep + 1):
            landing = next((work / f"generated-{rep}-{seed}").glob("*.jsonl"))
            # With the event log on, as the project's runs have it (they count their Spark jobs).
            floor = measure(case("floor_batch", landing=landing, out=work / f"floor-{rep}"),
                            env=counted(work / f"floor-{rep}"))
        processes["process_floor"].append(floor)
    m = warm["medians"]
    results = {"warm": m, "warm_rounds": warm["rounds"],
               **{part: {"wall_s": median(runs), "runs": [r["wall_s"] for r in runs],
                         "spark_jobs": runs[-1].get("spark_jobs"), "delta_commits": runs[-1].get("delta_commits")}
                  for part, runs in processes.items()}}
    results["ratios"] = {k: round(v, 2) for k, v in {
        "warm batch without event time / delta-spark floor (two appends and a MERGE) [target <= 1.3]":
            m["without_event_time"]["batch_s"] / m["floor"]["floor_s"],
        "the same, median of each round's ratio": statistics.median(
            r["without_event_time"]["batch_s"] / r["floor"]["floor_s"] for r in warm["rounds"]),
        "warm batch with sessions, seconds [target <= 3]": m["with_sessions"]["batch_s"],
        "warm run (scan, lock, query start, batch) without event time / floor":
            m["without_event_time"]["run_s"] / m["floor"]["floor_s"],
        "process run of 300 on a new root, seconds [target <= 6]": results["process_run_new_root"]["wall_s"],
        "process run of 300 more, seconds [target <= 6]": results["process_run_300_more"]["wall_s"],
        "process floor (a new process: Spark, two appends and a MERGE of the 300), seconds":
            results["process_floor"]["wall_s"],
        "process run of 300 more / process floor": results["process_run_300_more"]["wall_s"]
            / results["process_floor"]["wall_s"],
    }.items()}
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "repeat": repeat, "events": events, "bench_s": round(time.monotonic() - started)}
    rows = ["| part | batch s | run s | ingest s | state s | event time s | changelog s | Spark jobs | Delta commits |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("without_event_time", "with_sessions"):
        k = m[kind]
        rows.append(f"| {kind} | {k['batch_s']} | {k['run_s']} | {k.get('ingest_s', '')} | {k.get('state_s', '')} | "
                    f"{k.get('event_time_s', '')} | {k.get('changelog_s', '')} | {k['spark_jobs']} | "
                    f"{k['delta_commits']} |")
    f = m["floor"]
    rows.append(f"| floor: append {f['append_s']} + append {f['second_append_s']} + MERGE {f['merge_s']} | "
                f"{f['floor_s']} | | | | | | | 3 |")
    print("\n".join(rows))
    print(json.dumps(results["ratios"], indent=1))
    target = OUT if not quick else work.parent / f"statetables-bench-quick-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "batch.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {target}/batch.json")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def only_event_time_paths(sizes: list[int], repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    started = time.monotonic()
    data = Data(work / "data", min(INCREMENT_FILE_LINES, max(sizes) // 10 or 1))
    results: dict = {"cases": {}}
    try:
        for size in sizes:
            event_time_paths(data, size, repeat, work, partial(record_case, results), results)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    results["ratios"] = {k: round(v, 2) for size in sizes for k, v in event_time_ratios(results, size).items()}
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "repeat": repeat, "sizes": sizes, "bench_s": round(time.monotonic() - started)}
    print(json.dumps({"steps": {k: v["steps"] for k, v in results["cases"].items()}, "ratios": results["ratios"]},
                     indent=1))
    target = OUT if not quick else work.parent / f"statetables-bench-quick-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "event_time_paths.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {target}/event_time_paths.json")


def engine_runs(repeat: int, work: Path, *, history: int, increment: int) -> dict:
    """The whole-process time of `statetables run` (job advance_payments) on each engine, over a storage root that
    already holds `history` events: a run bringing `increment` new events (the orchestrated run's usual work), and a
    run with no new file. The Connect server and the standalone master + worker are started once and stay warm, as
    `make dev` and a deployment keep them; the embedded engine starts its JVM in every run. (e), the smallest
    embedded Spark + Delta process, is measured in every repetition too: the no-new-files target is a ratio to it.
    Runs alternate between engines so that drift on the machine spreads over all of them."""
    from statetables.servers import spark_connect_server, spark_standalone

    data = Data(work / "data", INCREMENT_FILE_LINES)
    small = work / "small_table"
    if not small.is_dir():
        import pyarrow as pa
        from deltalake import write_deltalake
        write_deltalake(str(small), pa.table({"id": list(range(10))}))
    engines = ("embedded", "connect", "standalone")
    homes = {name: work / f"engine-{name}" for name in engines}
    runs: dict[str, list[dict]] = {f"{name}_{kind}": [] for name in engines for kind in ("increment", "no_new_files")}
    minimal: list[dict] = []
    with spark_connect_server(port=15402, log=work / "connect.log") as remote, \
            spark_standalone(port=17402, log_dir=work / "standalone", worker_memory="4g") as master:
        urls = {"embedded": [], "connect": ["--remote", remote], "standalone": ["--master", master]}
        for name, home in homes.items():
            link_into(data.history(history), home / "landing" / "payments")
            measure(project_run(home) + urls[name], home)  # not timed: the history, once
        for i in range(repeat):
            minimal.append(measure(case("minimal", out=small)))
            for name, home in homes.items():
                link_into(data.increment(increment, 50 + i, customers=2000, after_s=i * increment),
                          home / "landing" / "payments", f"inc{i}-")
                for kind in ("increment", "no_new_files"):
                    run = measure(project_run(home) + urls[name], home)
                    runs[f"{name}_{kind}"].append(run)
                    print(f"engine {name:10s} {kind:12s} run {i + 1}: {run['wall_s']:6.1f} s, "
                          f"client peak {run['peak_rss_mb']['total']:.0f} MB", flush=True)
    results = {key: {"runs": [round(r["wall_s"], 2) for r in rs], "wall_s": median(rs),
                     "client_peak_rss_mb": max(r["peak_rss_mb"]["total"] for r in rs)} for key, rs in runs.items()}
    results["e_minimal_spark_delta_process"] = {"runs": [round(r["wall_s"], 2) for r in minimal],
                                                "wall_s": median(minimal)}
    for name in ("connect", "standalone"):
        for kind in ("increment", "no_new_files"):
            results[f"{name}_{kind}"]["vs_embedded"] = round(
                results[f"{name}_{kind}"]["wall_s"] / results[f"embedded_{kind}"]["wall_s"], 2)
        results[f"{name}_no_new_files"]["vs_e"] = round(
            results[f"{name}_no_new_files"]["wall_s"] / results["e_minimal_spark_delta_process"]["wall_s"], 2)
    return results


def _write_sized(results: dict, name: str, repeat: int, sizes: tuple[int, int], started: float, work: Path,
                 quick: bool) -> None:
    """Print results[name] and write the results, with the machine and sizes, to docs/bench/<name>.json (a scratch
    folder when quick)."""
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "repeat": repeat, "history_events": sizes[0], "increment_events": sizes[1],
                          "bench_s": round(time.monotonic() - started)}
    print(json.dumps(results[name], indent=1))
    target = OUT if not quick else work.parent / f"statetables-bench-quick-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {target}/{name}.json")


def only_engines(repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    started = time.monotonic()
    sizes = (2_000, 200) if quick else (20_000, 10_000)
    try:
        results = {"engines": engine_runs(repeat, work, history=sizes[0], increment=sizes[1])}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    _write_sized(results, "engines", repeat, sizes, started, work, quick)


def _upload(folder: Path, target, prefix: str = "") -> None:
    """Landing files into the bucket, in name order (not timed: producers' work)."""
    for path in sorted(folder.glob("*.jsonl")):
        (target / f"{prefix}{path.name}").write_bytes(path.read_bytes())


def _requests(endpoint: str) -> dict[str, int]:
    from statetables.servers import s3_request_counts

    totals: dict[str, int] = {}
    for (operation, _status), count in s3_request_counts(endpoint).items():
        totals[operation] = totals.get(operation, 0) + count
    return totals


def object_store_runs(repeat: int, work: Path, *, history: int, increment: int) -> dict:
    """`statetables run` (advance_payments) with the storage root on local disk and in a bucket of the development
    S3 server (s3proxy over this machine's disk, started here), side by side in each repetition: the bulk run over
    `history` events, then a run of `increment` new events on it. For the bucket, the S3 requests each run made (the
    server's metrics) in all and per micro-batch, by operation."""
    from pipelines.storage.files import S3Path
    from statetables.servers import S3_DEV_ACCESS_KEY, S3_DEV_SECRET_KEY, _stop, free_port, s3_server

    data = Data(work / "data", INCREMENT_FILE_LINES)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = s3_server(port=port, data_dir=work / "s3", log=work / "s3-server.log", access_key=S3_DEV_ACCESS_KEY,
                       secret_key=S3_DEV_SECRET_KEY, bucket="bench")
    store_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_DEV_ACCESS_KEY,
                 "AWS_SECRET_ACCESS_KEY": S3_DEV_SECRET_KEY, "AWS_REGION": "us-east-1"}
    os.environ.update(store_env)  # this process's uploads and listings
    runs: dict[str, list[dict]] = {f"{where}_{kind}": [] for where in ("local", "s3") for kind in ("bulk", "increment")}
    try:
        for rep in range(repeat):
            home = work / f"local-{rep}"
            link_into(data.history(history), home / "landing" / "payments")
            runs["local_bulk"].append(measure(project_run(home), home))
            root = S3Path("bench", f"rep-{rep}")
            _upload(data.history(history), root / "landing" / "payments")
            for kind in ("bulk", "increment"):
                if kind == "increment":
                    folder = data.increment(increment, seed=70 + rep, customers=max(2000, history // 10))
                    link_into(folder, home / "landing" / "payments", prefix="inc-")
                    runs["local_increment"].append(measure(project_run(home), home))
                    _upload(folder, root / "landing" / "payments", prefix="inc-")
                bronze = root / "tables" / "payments_bronze" / "_delta_log"
                commits_before = sum(1 for p in bronze.iterdir() if p.suffix == ".json")
                before = _requests(endpoint)
                run = measure(project_run(home), env={"STATETABLES_HOME": str(root),
                                                      "DAGSTER_HOME": str(work / "dagster")})
                after = _requests(endpoint)
                made = {op: after[op] - before.get(op, 0) for op in after if after[op] > before.get(op, 0)}
                batches = sum(1 for p in bronze.iterdir() if p.suffix == ".json") - commits_before - (kind == "bulk")
                run.update(requests=sum(made.values()), requests_by_operation=made, micro_batches=batches,
                           requests_per_batch=round(sum(made.values()) / batches) if batches else None)
                runs[f"s3_{kind}"].append(run)
                print(f"{kind:9s} rep {rep + 1}: local {runs[f'local_{kind}'][-1]['wall_s']:6.1f} s, "
                      f"s3 {run['wall_s']:6.1f} s, {run['requests']} requests in {batches} micro-batch(es)",
                      flush=True)
    finally:
        _stop(server)
    results = {key: {"runs": [round(r["wall_s"], 2) for r in rs], "wall_s": median(rs)} for key, rs in runs.items()}
    for kind in ("bulk", "increment"):
        s3 = runs[f"s3_{kind}"]
        results[f"s3_{kind}"].update(
            vs_local=round(results[f"s3_{kind}"]["wall_s"] / results[f"local_{kind}"]["wall_s"], 2),
            requests=int(statistics.median(r["requests"] for r in s3)),
            micro_batches=int(statistics.median(r["micro_batches"] for r in s3)),
            requests_per_batch=statistics.median(r["requests_per_batch"] or 0 for r in s3),
            requests_by_operation=s3[-1]["requests_by_operation"])
    return results


def only_object_store(repeat: int, work: Path, *, keep: bool, quick: bool) -> None:
    started = time.monotonic()
    sizes = (20_000, 2_000) if quick else (1_000_000, 10_000)
    try:
        results = {"object_store": object_store_runs(repeat, work, history=sizes[0], increment=sizes[1])}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    _write_sized(results, "object_store", repeat, sizes, started, work, quick)


# Each arrival rate is held this long: long enough for the batches a continuous run grows to at 20,000 events/s (several
# seconds each) to show whether the lag climbs from one to the next.
RATE_STEP_S = 60


def only_freshness(work: Path, *, keep: bool, quick: bool) -> None:
    """Freshness of payments_per_customer, continuous against orchestrated, under `dagster dev`
    (benchmarks/freshness.py), into docs/bench/freshness.json."""
    from benchmarks.freshness import run_mode
    from pipelines.ingest.generate import generate
    from pipelines.declare.project import stream_spec

    started = time.monotonic()
    files, every_s = (10, 2.0) if quick else (60, 2.0)
    results: dict = {}
    # (name, mode, through a warm Connect server beside Dagster as `make dev` runs it, arrival rates to try)
    modes = [("orchestrated_connect", "orchestrated", True, []), ("orchestrated", "orchestrated", False, []),
             ("continuous_connect", "continuous", True, [1_000, 5_000, 20_000])]
    try:
        for name, mode, engine, steps in modes:
            home = work / f"freshness-{name}"
            generate(stream_spec("payments"), home / "landing" / "payments" / "history", events=2_000, seed=3, events_per_file=1_000)
            measure(project_run(home), home)  # not timed: the tables and checkpoints exist, as in production
            results[name] = run_mode(home, mode, files=files, every_s=every_s, rate_steps=[] if quick else steps,
                                     rate_seconds=RATE_STEP_S, engine=engine)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    results["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                          "files": files, "every_s": every_s, "bench_s": round(time.monotonic() - started)}
    _write_freshness(results, work, quick)


def _write_freshness(results: dict, work: Path, quick: bool) -> None:
    """Into docs/bench/freshness.json (quick: beside the scratch folder), keeping the modes another command wrote."""
    print(json.dumps(results, indent=1))
    target = OUT if not quick else work.parent / f"statetables-bench-quick-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    path = target / "freshness.json"
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **results}, indent=1,
                               default=str) + "\n")
    print(f"written: {path}")


KAFKA_PROJECT_SOURCE = "    source: {topic: payments-events}\n"


def only_freshness_kafka(work: Path, *, keep: bool, quick: bool) -> None:
    """Freshness from a Kafka topic: records produced to payments' topic → visible in payments_per_customer, the
    continuous job through a warm Connect server, as `continuous_connect` measures files; a broker of the
    project's own (statetables/servers.py). Into docs/bench/freshness.json, beside the file modes."""
    from benchmarks.freshness import TopicArrivals, run_mode
    from pipelines.ingest.generate import generate
    from pipelines.declare.project import SHIPPED, load_project
    from statetables.servers import kafka_broker

    started = time.monotonic()
    files, every_s = (10, 2.0) if quick else (60, 2.0)
    steps = [] if quick else [1_000, 5_000, 20_000]
    home = work / "freshness-kafka"
    home.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("STATETABLES_PROJECT")
    try:
        with kafka_broker(work / "kafka") as broker:
            project = home / "statetables.yaml"
            project.write_text(SHIPPED.read_text().replace("  payments:\n", "  payments:\n" + KAFKA_PROJECT_SOURCE)
                               + f"\nkafka:\n  bootstrap_servers: {broker.bootstrap}\n")
            os.environ["STATETABLES_PROJECT"] = str(project)  # the runs, dagster dev and the Connect server read it
            spec = load_project(project.read_text(), project).streams["payments"]
            generate(spec, spec.topic, events=2_000, seed=3, events_per_file=1_000)
            measure(project_run(home), home)  # not timed: the tables and checkpoints exist, as in production
            TopicArrivals.topic = spec.topic
            result = run_mode(home, "continuous", files=files, every_s=every_s, rate_steps=steps, rate_seconds=RATE_STEP_S,
                              engine=True, kind=TopicArrivals)
    finally:
        if saved is None:
            os.environ.pop("STATETABLES_PROJECT", None)
        else:
            os.environ["STATETABLES_PROJECT"] = saved
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                         "records_sets": files, "every_s": every_s, "bench_s": round(time.monotonic() - started)}
    _write_freshness({"continuous_kafka_connect": result}, work, quick)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition: checks the harness")
    parser.add_argument("--full", action="store_true", help="also 10M events (~1M customers) and 10k increments")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    parser.add_argument("--only", choices=["batch", "core", "history", "paths", "engines", "freshness", "freshness-kafka",
                                            "object-store"],
                        help="batch: a micro-batch of 300 payments warm and as a process, each step's seconds, "
                        "jobs and commits, beside plain delta-spark's appends and MERGE of the same rows, into "
                        "docs/bench/batch.json; core: the bulk run, the "
                        "increment as a process and warm, against Spark's floor and a full recompute, with jobs and "
                        "commits per micro-batch, into docs/bench/core.json; history: +100k as a process and warm on 1M and "
                        "on 5M of history, into docs/bench/history.json; paths: only case (g), the "
                        "event-time paths, into docs/bench/event_time_paths.json; engines: `statetables run` per Spark "
                        "engine, into docs/bench/engines.json; freshness: landing file to state table, continuous and "
                        "orchestrated, into docs/bench/freshness.json; freshness-kafka: records produced to a topic to state table, "
                        "continuous, into the same file; object-store: the 1M bulk run and a 10k increment on local disk and in "
                        "a bucket of the development S3 server, with S3 requests per micro-batch, into "
                        "docs/bench/object_store.json. All leave the full results as they are")
    args = parser.parse_args()
    sizes, increments, repeat = [1_000_000], [100_000], args.repeat
    if args.full:
        sizes, increments = [1_000_000, 10_000_000], [10_000, 100_000]
    if args.quick:
        sizes, increments, repeat = [20_000], [5_000], 1
    work = Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"statetables-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.only == "batch":
        return only_batch(repeat if not args.quick else 1, work, keep=bool(args.work), quick=args.quick)
    if args.only == "core":
        return only_core(repeat, work, keep=bool(args.work), quick=args.quick)
    if args.only == "history":
        return only_history(repeat, work, keep=bool(args.work), quick=args.quick)
    if args.only == "paths":
        return only_event_time_paths(sizes, repeat, work, keep=bool(args.work), quick=args.quick)
    if args.only == "engines":
        return only_engines(repeat if not args.quick else 2, work, keep=bool(args.work), quick=args.quick)
    if args.only == "freshness":
        return only_freshness(work, keep=bool(args.work), quick=args.quick)
    if args.only == "freshness-kafka":
        return only_freshness_kafka(work, keep=bool(args.work), quick=args.quick)
    if args.only == "object-store":
        return only_object_store(repeat, work, keep=bool(args.work), quick=args.quick)
    try:
        results = bench(sizes, increments, repeat, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    results["ratios"] = ratios(results, sizes, increments)
    results["machine"] = {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                          "platform": platform.platform(), "python": platform.python_version(),
                          "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "repeat": repeat,
                          "sizes": sizes, "increments": increments, "bench_s": round(time.monotonic() - started)}
    table = markdown(results)
    print(table)
    target = OUT if not args.quick else work.parent / f"statetables-bench-quick-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (target / "results.md").write_text(table)
    plot(results, sizes, target / "bench.png")
    print(f"written: {target}/results.json, results.md, bench.png")


if __name__ == "__main__":
    main()
