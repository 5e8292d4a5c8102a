"""Which blocking checks stop a run, as a Dagster resource: the operator's switch for a check that is wrong."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from pipelines.declare.project import streams
from pipelines.errors import ConfigurationError

DEEP_CHECK = "reconciles_with_bronze"  # a table against all of bronze: nightly and on demand, not every run
STATE_TABLE_CHECKS = ("totals_match_bronze", DEEP_CHECK, "unique_keys", "nothing_negative")
RECONCILE = "reconcile_with_bronze"  # a windowed or session table against its declared query over bronze
TOP_MATCHES = "top_n_matches_its_table"  # a top N against its declared query over its windowed table


def blocking_check_names() -> list[str]:
    """Every blocking check as ASSET:CHECK (a test holds this list to the definitions' own). Written out from the
    project file, not read from the definitions, which import this resource."""
    specs = streams().values()
    return sorted([*(f"{t.name}:{check}" for spec in specs for t in spec.state_tables for check in STATE_TABLE_CHECKS),
                   *(f"{t.name}:{check}" for spec in specs for t in spec.event_time_tables
                     for check in (RECONCILE, DEEP_CHECK)),
                   *(f"{top.name}:{TOP_MATCHES}" for spec in specs for t in spec.event_time_tables for top in t.tops)])

WARN_ONLY_NOTE = ("failed, reported as a warning: this run lists the check in resource check_policy.warn_only "
                  "(docs/recovery.md, 'A blocking check fails on a correct table')")


class CheckPolicyResource(dg.ConfigurableResource):
    """Every blocking check blocks by default. A check listed in `warn_only` still runs and shows its figures,
    but a failure is reported with WARN severity, which Dagster does not block on: the run goes on. For one
    run, when an independent read shows the table right and the check wrong (docs/recovery.md)."""

    warn_only: list[str] = Field(default_factory=list, description=(
        "Blocking checks whose failure warns instead of stopping the run, as ASSET:CHECK, e.g. "
        '["customer_activity:reconcile_with_bronze"]. Empty: every blocking check blocks. For one '
        "run only, after an independent read showed the table right (docs/recovery.md)."))

    def severity(self, asset: str, check: str) -> dg.AssetCheckSeverity:
        known = blocking_check_names()
        unknown = sorted(set(self.warn_only) - set(known))
        if unknown:
            raise ConfigurationError(f"check_policy.warn_only names no blocking check: {', '.join(unknown)}. "
                                     f"Fix: use ASSET:CHECK, one of {', '.join(known)}.")
        return dg.AssetCheckSeverity.WARN if f"{asset}:{check}" in self.warn_only else dg.AssetCheckSeverity.ERROR

    def result(self, asset: dg.AssetKey, check: str, *, passed: bool, metadata: dict,
               name_asset: bool = True) -> dg.AssetCheckResult:
        """A blocking check's result at the severity this run gives it. `name_asset` False for an @asset_check,
        whose result Dagster ties to its one asset."""
        severity = self.severity(asset.to_user_string(), check)
        if severity == dg.AssetCheckSeverity.WARN and not passed:
            metadata = {**metadata, "blocking": WARN_ONLY_NOTE}
        return dg.AssetCheckResult(check_name=check, asset_key=asset if name_asset else None, passed=passed,
                                   severity=severity, metadata=metadata)
