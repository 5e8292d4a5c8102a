"""Case (h), the peer: Apache Flink 2.3's streaming job over the same payment landing files, dedup by payment id and
GROUP BY customer, as Flink SQL on PyFlink. It runs in a virtualenv of its own (`make flink`: PyFlink pins its own
pyarrow, pandas and Beam) and imports nothing of this project.

    .venv-flink/bin/python benchmarks/flink_peer.py --landing <folder of payment files>

What it does not do that statetables does: its JSON reader skips a malformed line without a trace (no quarantine),
it keeps its state in memory for the job only (nothing commits, nothing survives the process) and its result goes
to Flink's blackhole sink (no table is written). So it is a floor for a streaming engine on these files, not a
product doing the same work. Prints one `RESULT {...}` line with its seconds.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--landing", required=True, help="a folder of payment JSON-lines files")
    parser.add_argument("--parallelism", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    from pyflink.table import EnvironmentSettings, TableEnvironment

    env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    env.get_config().set("parallelism.default", str(args.parallelism))
    env.execute_sql(f"""
        CREATE TABLE payments (
            payment_id STRING, customer_id STRING, amount DECIMAL(18, 2), paid_at TIMESTAMP_LTZ(3),
            proc AS PROCTIME()
        ) WITH ('connector' = 'filesystem', 'path' = 'file://{args.landing}', 'format' = 'json',
                'json.ignore-parse-errors' = 'true', 'json.timestamp-format.standard' = 'ISO-8601')""")
    env.execute_sql("""
        CREATE TABLE per_customer (
            customer_id STRING, payment_count BIGINT, total_amount DECIMAL(28, 2), last_paid_at TIMESTAMP_LTZ(3)
        ) WITH ('connector' = 'blackhole')""")
    ready = time.monotonic()
    env.execute_sql("""
        INSERT INTO per_customer
        SELECT customer_id, COUNT(*), CAST(SUM(amount) AS DECIMAL(28, 2)), MAX(paid_at)
        FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY payment_id ORDER BY proc ASC) AS first_seen FROM payments
              WHERE payment_id IS NOT NULL AND customer_id IS NOT NULL AND amount IS NOT NULL)
        WHERE first_seen = 1
        GROUP BY customer_id""").wait()
    done = time.monotonic()
    print("RESULT " + json.dumps({"work_s": round(done - ready, 2), "setup_s": round(ready - started, 2)}), flush=True)


if __name__ == "__main__":
    main()
