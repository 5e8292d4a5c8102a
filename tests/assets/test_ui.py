"""The Dagster UI as an operator's cockpit, in a real headless Chromium driven by Playwright, over `dagster dev`
(webserver + daemon) on 127.0.0.1 and a storage root with generated landing files.

As `make dev` runs it: every run a thin client of a warm Spark Connect engine beside Dagster. What a person does
and sees, in the browser only (clicks, no GraphQL mutation):
1. the asset graph, both streams' groups expanded: every asset;
2. the landing sensor switched off on its page, so runs are launched by hand; then advance_payments launched
   with the job page's "Materialize all";
3. the run's page, until it shows Success;
4. payments_per_customer's page: what the run did (lines read, accepted, quarantined, duplicates, batches,
   versions, duration), the latest event time, the top rows as a table; its checks tab, every check passed;
   the quarantine's page: the run's reasons, as a table;
5. a fault armed as in the recovery tests, more files, the next clicked run fails after its bronze commit: its
   page shows the failure, and the recovery run the daemon's run-failure sensor launched shows why it ran (its
   tags, and the state table's metadata: the failed run as a link, the fault); the table's freshness policy
   passes, and its plots draw each figure over the two runs. The state table equals the independent oracle.

This is also the test of recovery without a person: the real daemon's sensor launches the recovery run.

Each step is a screenshot under $STATETABLES_UI_SHOTS (a temporary folder; `make ui-screenshots` writes docs/ui/).

In the long tier (`make test-long` and `make test-all`, which install Chromium first: `make browser`): three minutes
of a browser and two servers, more than a third of the fast loop's time.
Not covered: the continuous job's pages (tests/assets/test_continuous.py follows it through GraphQL) and
Dagster+ features.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from deltalake import DeltaTable as IndependentDeltaTable
from playwright.sync_api import Page, expect, sync_playwright

from assets.automation import FAILURE_SENSOR_ENV, LANDING_SENSOR_ENV
from assets.keys import RECOVERY_OF_TAG
from pipelines import faults
from pipelines.ingest.generate import generate
from tests.streams import PAYMENTS, STREAMS
from resources.spark import ENGINE_TAG
from statetables.definitions import defs
from statetables.servers import RUN_ENDED, dagster_dev, free_port, graphql, list_runs, sensor_ticks, wait_for_run_end
from tests.contract_oracle import expected_state, landing_files

pytestmark = pytest.mark.long

SHOTS_ENV = "STATETABLES_UI_SHOTS"
# Chromium on a closed network: no background services that would try (and fail) to reach Google.
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_MS = 300_000
LOCATION = "statetables.definitions:defs"
# The daemon evaluates freshness policies every 30 s by default; every 5 s here, so the test waits less.
FRESHNESS_INTERVAL_ENV = {"FRESHNESS_DAEMON_INTERVAL_SECONDS": "5"}
_FRESHNESS = """query Fresh($key: AssetKeyInput!) { assetNodeOrError(assetKey: $key) {
  ... on AssetNode { freshnessStatusInfo { freshnessStatus } } } }"""


@contextmanager
def chromium() -> Iterator[Page]:
    """Debian's chromium where `make browser` installed it, else the browser Playwright downloaded there."""
    executable = shutil.which("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def _all_asset_names() -> list[str]:
    return sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys())


def wait_for(condition, what: str, timeout_s: float = RUN_TIMEOUT_MS / 1000):
    """Poll `condition` every 2 s until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (answer := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(2)
    return answer


def first_tick_ended(url: str, sensor: str) -> bool:
    """Whether the sensor's first tick (the daemon evaluates it when it starts) has ended."""
    ticks = sensor_ticks(url, sensor, limit=1)
    return bool(ticks) and ticks[0]["status"] != "STARTED"


def open_finished_run(page: Page, url: str, run_id: str) -> None:
    """Wait for a run to end with the browser on a blank page, then open the run's page. A running run's page
    redraws its timeline many times a second: watching it cost Chromium a third of this test's CPU."""
    page.goto("about:blank")
    assert wait_for_run_end(url, run_id, RUN_TIMEOUT_MS / 1000) in RUN_ENDED, f"run {run_id} did not end"
    page.goto(f"{url}/runs/{run_id}")


def test_an_operator_sees_every_asset_what_a_run_did_and_why_a_recovery_ran(layout, tmp_path):
    shots = Path(os.environ.get(SHOTS_ENV) or tmp_path / "ui")
    shots.mkdir(parents=True, exist_ok=True)
    fault_dir = layout.home / "faults"
    landing = layout.landing(PAYMENTS.name)

    def shot(page: Page, name: str) -> None:
        # A page shows "Loading…" until its queries answer: the picture is of the data, not of the spinners.
        expect(page.get_by_text(re.compile(r"^Loading(…|\.\.\.)$"))).to_have_count(0, timeout=60_000)
        page.wait_for_timeout(800)  # let the last poll's data render
        page.screenshot(path=str(shots / f"{name}.png"))

    def asset_graph(page: Page) -> None:
        """The asset graph, every group expanded (a tall window: the graph draws only the nodes in view)."""
        page.set_viewport_size({"width": 1600, "height": 1500})
        page.goto(f"{url}/asset-groups")
        expect(page.get_by_text("Global asset lineage")).to_be_visible()
        for group in STREAMS:
            expect(page.get_by_text(group, exact=True).first).to_be_visible()
        page.mouse.click(600, 960, button="right")  # the graph's empty corner: its context menu
        expect(page.get_by_role("menuitem").first).to_be_visible()
        expand = page.get_by_role("menuitem", name="Expand all groups")
        if expand.count():
            expand.click()
        else:  # expanded already (the UI keeps it from the first visit)
            page.keyboard.press("Escape")
        for _ in range(2):
            page.get_by_role("img", name="zoom_out").click()
        for name in _all_asset_names():
            expect(page.get_by_text(name, exact=True).first).to_be_visible()

    def launch_advance_payments(page: Page) -> str:
        page.goto(f"{url}/locations/{LOCATION}/jobs/advance_payments")
        page.get_by_role("button", name="Materialize all").click()
        toast = page.locator('a[href^="/runs/"]', has_text="View")  # the toast: "Launched run <id>  View"
        expect(toast).to_be_visible()
        run_id = re.search(r"/runs/([0-9a-f-]{36})", toast.get_attribute("href")).group(1)
        toast.click()
        return run_id

    # As `make dev`: every run is a thin client of a warm Spark Connect engine (the faults fire in its foreachBatch).
    # The landing sensor ticks once when the daemon starts (landing is empty then) and not again for an hour: a tick
    # already under way when the test switches it off would otherwise take the files the test's own run reads.
    # The failure sensor every 5 s: the recovery run starts seconds after the failure, not up to 30 s.
    dagster_env = {faults.FAULTS_ENV: str(fault_dir), LANDING_SENSOR_ENV: "3600", FAILURE_SENSOR_ENV: "5",
                   **FRESHNESS_INTERVAL_ENV}
    engine_port = free_port()
    remote = f"sc://127.0.0.1:{engine_port}"
    with dagster_dev(layout, port=free_port(), engine_port=engine_port, extra_env=dagster_env) as url, \
            chromium() as page:
        # 1. Every asset in the graph, grouped by stream (its picture is taken at the end, with the runs' data).
        asset_graph(page)
        page.set_viewport_size({"width": 1600, "height": 1000})

        # 2. Runs by hand: the landing sensor off (its page's switch), files in landing, "Materialize all".
        wait_for(lambda: first_tick_ended(url, "landing_files_sensor"), "the landing sensor's first tick")
        page.goto(f"{url}/locations/{LOCATION}/sensors/landing_files_sensor")
        switch = page.get_by_role("checkbox")
        expect(switch).to_be_checked()
        switch.locator("xpath=..").click()  # the drawn switch is the input's label
        expect(switch).not_to_be_checked()
        generate(PAYMENTS, landing, events=600, malformed=0.03, duplicates=0.03, conflicts=0.01, seed=5,
                 events_per_file=300)
        first_run = launch_advance_payments(page)

        # 3. The run succeeds.
        open_finished_run(page, url, first_run)
        expect(page.get_by_text("Success", exact=True).first).to_be_visible()
        shot(page, "2-run-succeeded")

        # 4. The state table's page: what the run did, its top rows; its checks with their evidence.
        page.goto(f"{url}/assets/payments_per_customer")
        for key in ("lines_read", "rows_accepted", "rows_quarantined", "duplicates_recognised", "micro_batches",
                    "bronze_table_version", "table_version", "duration_s", "latest_event_time", "top_rows"):
            expect(page.get_by_text(key, exact=True).first).to_be_visible()
        expect(page.get_by_text("600", exact=True).first).to_be_visible()  # lines_read
        shot(page, "3-state-table")
        page.goto(f"{url}/assets/payments_per_customer?view=checks")
        for check in ("totals_match_bronze", "unique_keys", "nothing_negative"):
            expect(page.get_by_text(check, exact=True).first).to_be_visible()
        expect(page.get_by_text("Failed", exact=True)).to_have_count(0)
        shot(page, "4-state-table-checks")
        page.goto(f"{url}/assets/payments_quarantine")  # what was quarantined in that run, and why
        expect(page.get_by_text("reasons", exact=True).first).to_be_visible()
        expect(page.get_by_text(re.compile(r"^(invalid_utf8|not_json|not_object|missing_field|wrong_type|empty_field|"
                                           r"too_long|out_of_range|too_many_decimals|invalid_timestamp|"
                                           r"conflicting_duplicate)$")).first).to_be_visible()
        shot(page, "5-quarantine-reasons")

        # 5. A fault after the bronze commit of the next run: it fails, and the daemon recovers it.
        faults.arm(fault_dir, faults.INGEST_AFTER_BRONZE_COMMIT, "raise")
        generate(PAYMENTS, landing, events=300, malformed=0.03, duplicates=0.03, seed=6, events_per_file=300)
        failed_run = launch_advance_payments(page)
        open_finished_run(page, url, failed_run)
        expect(page.get_by_text("Failure", exact=True).first).to_be_visible()
        expect(page.get_by_text("fault injected at ingest.after_bronze_commit").first).to_be_attached()
        shot(page, "6-failed-run")
        recovery = wait_for(lambda: next((r for r in list_runs(url) if r["tags"].get(RECOVERY_OF_TAG) == failed_run),
                                         None), f"a recovery run of {failed_run}")
        open_finished_run(page, url, recovery["runId"])
        expect(page.get_by_text("recover_failed_stream").first).to_be_visible()  # "Launched by"
        expect(page.get_by_text("Success", exact=True).first).to_be_visible()
        page.get_by_role("button", name="View tags and config").click()
        expect(page.get_by_text(f"statetables/recovery_of: {failed_run}")).to_be_visible()
        expect(page.get_by_text(f"{ENGINE_TAG}: {remote}")).to_be_visible()  # the engine the run used
        expect(page.get_by_text(re.compile(r"statetables/recovery_reason: run .* failed: payments: "
                                           r".*fault injected at ingest.after_bronze_commit"))).to_be_visible()
        shot(page, "7-recovery-run")
        page.keyboard.press("Escape")
        # The state table after the recovery: why it ran (a link to the failed run), and fresh. The daemon
        # evaluates freshness policies on its own clock: the page is opened once it has.
        key = {"path": [PAYMENTS.state_tables[0].name]}
        wait_for(lambda: graphql(url, _FRESHNESS, {"key": key})["assetNodeOrError"]["freshnessStatusInfo"][
            "freshnessStatus"] == "HEALTHY", "the freshness policy's evaluation", timeout_s=90)
        page.goto(f"{url}/assets/payments_per_customer")
        expect(page.get_by_text("recovery_reason", exact=True).first).to_be_visible()
        expect(page.get_by_text("Passing", exact=True).first).to_be_visible()  # the freshness policy
        expect(page.get_by_text(re.compile("fault injected at ingest.after_bronze_commit")).first).to_be_visible()
        expect(page.get_by_role("link", name=re.compile(failed_run[:8])).first).to_be_visible()
        shot(page, "8-state-table-after-recovery")
        # Two runs now: the plots tab draws each numeric figure over time.
        page.get_by_text("Plots", exact=True).click()
        expect(page.get_by_text("duration_s", exact=True).first).to_be_visible()
        expect(page.get_by_text("lines_read", exact=True).first).to_be_visible()
        shot(page, "9-state-table-plots")
        # The asset graph again, now with each asset's latest event and checks.
        asset_graph(page)
        shot(page, "1-asset-graph")
        assert first_run != failed_run
        assert {run["tags"].get(ENGINE_TAG) for run in list_runs(url)} == {remote}

    assert not (fault_dir / faults.INGEST_AFTER_BRONZE_COMMIT).exists()  # the fault really fired
    expected = expected_state(PAYMENTS.name, landing_files(landing))
    table = PAYMENTS.state_tables[0]
    rows = IndependentDeltaTable(str(layout.table(table.name))).to_pyarrow_table().to_pylist()
    assert {r[table.key]: (r[table.count_column], r[table.sum_column]) for r in rows} == {
        k: (expected.counts[k], expected.sums[k]) for k in expected.counts}
