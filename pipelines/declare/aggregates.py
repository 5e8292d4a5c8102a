"""The aggregate kinds a table may declare, one row each: how the SQL spells it, the columns that keep its partial
value, and how partials are computed over rows (or of one row alone), combined across batches, merged into a table
and finished.

Every table that aggregates (state, windowed and session tables, their checks and refreshes) reads its aggregates
through `KINDS`, so a kind is added or changed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, DecimalType, DoubleType, LongType, StructField, StructType
from pyspark.sql.window import WindowSpec

from pipelines.declare.specs import FIELD_TYPES, Aggregate, FieldRule
from pipelines.storage.delta_sql import ident

TOTAL_TYPE = DecimalType(28, 2)  # what Spark's SUM of DECIMAL(18,2) yields
AVERAGE_TYPE = DecimalType(22, 6)  # ... and its AVG
Fields = dict[str, FieldRule]


def _summed_type(kind: str) -> DataType:
    return TOTAL_TYPE if kind == "decimal" else LongType()


def _over(aggregate: Column, window: WindowSpec | None) -> Column:
    """`aggregate` as an aggregation's column, or over `window` (a window function, on each of its rows)."""
    return aggregate if window is None else aggregate.over(window)


def _rank(a: Aggregate) -> str:
    return f"_rank_{a.name}"


def _best(a: Aggregate, value: Column, window: WindowSpec | None) -> Column:
    """`value` where a window's rows are ranked (`ranks`) among the best `a.n`, otherwise NULL (which a list skips);
    `value` itself in an aggregation."""
    return value if window is None else F.when(F.col(_rank(a)) <= a.n, value)


def _counted(column: str | None) -> Column:
    """COUNT(column) of one row: 1, or 0 where the column is NULL; COUNT(*) when there is none."""
    return (F.lit(1) if column is None else F.when(F.col(column).isNotNull(), 1).otherwise(0)).cast(LongType())


def _either(t: str, s: str) -> str:
    """The SUM of two partial sums, either of which is NULL when its rows held no value."""
    return f"coalesce({t} + {s}, {t}, {s})"


@dataclass(frozen=True)
class AggregateKind:
    """One row of the table. `sqlglot_class`: the sqlglot expression the SQL parses to; `argument`: "row or
    column" (COUNT), "number" (a decimal or integer field), "column" (any field), "value and ordering"."""

    sqlglot_class: str
    argument: str

    def fields(self, a: Aggregate, field: Fields) -> list[StructField]:
        """The columns that hold the partial value, from which batches combine and the declared value follows."""
        return [StructField(a.name, self.final_type(a, field))]

    def final_type(self, a: Aggregate, field: Fields) -> DataType:
        """The declared column's type: what Spark's aggregate yields."""
        raise NotImplementedError

    def shown_as_kept(self) -> bool:
        """Whether the partial value is the declared value itself (no hidden columns)."""
        return True

    def never_null(self, a: Aggregate, field: Fields) -> bool:
        return False

    def partial(self, a: Aggregate, kinds: dict[str, str], over: WindowSpec | None = None) -> list[Column]:
        """The partial columns over rows of the stream (`groupBy(...).agg`; with `over`, each aggregate over that
        window, on every row of it)."""
        raise NotImplementedError

    def of_row(self, a: Aggregate, kinds: dict[str, str]) -> list[Column]:
        """The partial columns of each row of the stream alone (a projection, no aggregation): `partial` over that
        one row, so that `combined` reads rows of the stream and rows of partials alike."""
        raise NotImplementedError

    def ranks(self, a: Aggregate, over: WindowSpec, combining: bool) -> dict[str, Column]:
        """Columns that `partial` (or, `combining`, `combined`) over the window `over` reads, added to the rows
        before it (`window_ranks`); none for most kinds."""
        return {}

    def combined(self, a: Aggregate, kinds: dict[str, str], over: WindowSpec | None = None) -> list[Column]:
        """The partial columns over rows of partial columns: several batches' partials of one key as one (`over`:
        as `partial`'s)."""
        raise NotImplementedError

    def final(self, a: Aggregate, kinds: dict[str, str]) -> Column:
        """The declared value from the partial columns."""
        return F.col(a.name)

    def merged(self, a: Aggregate, types: dict[str, str], field: Fields) -> list[str]:
        """The MERGE's SET clauses combining a table row `t` with a batch row `s`."""
        raise NotImplementedError


class _Count(AggregateKind):
    def final_type(self, a, field):
        return LongType()

    def fields(self, a, field):
        return [StructField(a.name, LongType(), nullable=False)]

    def never_null(self, a, field):
        return True

    def partial(self, a, kinds, over=None):
        return [_over(F.count(a.column or F.lit(1)), over).alias(a.name)]

    def of_row(self, a, kinds):
        return [_counted(a.column).alias(a.name)]

    def combined(self, a, kinds, over=None):
        return [_over(F.sum(a.name), over).cast(LongType()).alias(a.name)]

    def merged(self, a, types, field):
        c = ident(a.name)
        return [f"t.{c} = t.{c} + s.{c}"]


class _Sum(AggregateKind):
    def final_type(self, a, field):
        return _summed_type(field[a.column].kind)

    def fields(self, a, field):
        return [StructField(a.name, self.final_type(a, field), nullable=not field[a.column].required)]

    def never_null(self, a, field):
        return field[a.column].required

    def partial(self, a, kinds, over=None):
        return [_over(F.sum(a.column), over).cast(_summed_type(kinds[a.column])).alias(a.name)]

    def of_row(self, a, kinds):
        return [F.col(a.column).cast(_summed_type(kinds[a.column])).alias(a.name)]

    def combined(self, a, kinds, over=None):
        return [_over(F.sum(a.name), over).cast(_summed_type(kinds[a.column])).alias(a.name)]

    def merged(self, a, types, field):
        c = ident(a.name)
        # A required field's sums are never NULL: plain addition.
        total = f"t.{c} + s.{c}" if field[a.column].required else _either(f"t.{c}", f"s.{c}")
        return [f"t.{c} = CAST({total} AS {types[a.name]})"]


@dataclass(frozen=True)
class _Extreme(AggregateKind):
    function: str = "min"  # or "max"

    def final_type(self, a, field):
        return FIELD_TYPES[field[a.column].kind]

    def never_null(self, a, field):
        return field[a.column].required

    def partial(self, a, kinds, over=None):
        return [_over(getattr(F, self.function)(a.column), over).alias(a.name)]

    def of_row(self, a, kinds):
        return [F.col(a.column).alias(a.name)]

    def combined(self, a, kinds, over=None):
        return [_over(getattr(F, self.function)(a.name), over).alias(a.name)]

    def merged(self, a, types, field):
        c = ident(a.name)
        return [f"t.{c} = {'least' if self.function == 'min' else 'greatest'}(t.{c}, s.{c})"]


def _avg_sum(a: Aggregate) -> str:
    return f"_avg_{a.name}_sum"


def _avg_count(a: Aggregate) -> str:
    return f"_avg_{a.name}_count"


class _Avg(AggregateKind):
    """An exact sum and count, so that batches combine without rounding; finished as Spark's AVG would."""

    def final_type(self, a, field):
        return AVERAGE_TYPE if field[a.column].kind == "decimal" else DoubleType()

    def fields(self, a, field):
        return [StructField(_avg_sum(a), _summed_type(field[a.column].kind)), StructField(_avg_count(a), LongType())]

    def shown_as_kept(self):
        return False

    def partial(self, a, kinds, over=None):
        return [_over(F.sum(a.column), over).cast(_summed_type(kinds[a.column])).alias(_avg_sum(a)),
                _over(F.count(a.column), over).alias(_avg_count(a))]

    def of_row(self, a, kinds):
        return [F.col(a.column).cast(_summed_type(kinds[a.column])).alias(_avg_sum(a)),
                _counted(a.column).alias(_avg_count(a))]

    def combined(self, a, kinds, over=None):
        return [_over(F.sum(_avg_sum(a)), over).cast(_summed_type(kinds[a.column])).alias(_avg_sum(a)),
                _over(F.sum(_avg_count(a)), over).cast(LongType()).alias(_avg_count(a))]

    def final(self, a, kinds):
        total, count = F.col(_avg_sum(a)), F.col(_avg_count(a))
        # For decimals, the division Spark's Average itself does.
        if kinds[a.column] == "decimal":
            value = (total / count.cast(DecimalType(20, 0))).cast(AVERAGE_TYPE)
        else:
            value = total.cast(DoubleType()) / count.cast(DoubleType())
        return F.when(count > 0, value).alias(a.name)

    def merged(self, a, types, field):
        c, total, count = ident(a.name), ident(_avg_sum(a)), ident(_avg_count(a))
        merged_total = f"CAST({_either(f't.{total}', f's.{total}')} AS {types[_avg_sum(a)]})"
        merged_count = f"t.{count} + s.{count}"
        average = (f"CAST({merged_total} / CAST({merged_count} AS DECIMAL(20,0)) AS {types[a.name]})"
                   if field[a.column].kind == "decimal"
                   else f"CAST({merged_total} AS DOUBLE) / CAST({merged_count} AS DOUBLE)")
        return [f"t.{c} = CASE WHEN {merged_count} > 0 THEN {average} END",
                f"t.{total} = {merged_total}", f"t.{count} = {merged_count}"]


def _by(a: Aggregate) -> str:
    return f"_by_{a.name}"


@dataclass(frozen=True)
class _ExtremeBy(AggregateKind):
    """MIN_BY/MAX_BY: the (ordering, value) pair kept beside the value; with `n`, the `n` most extreme pairs."""

    function: str = "min_by"  # or "max_by"

    def final_type(self, a, field):
        value = FIELD_TYPES[field[a.column].kind]
        return ArrayType(value) if a.n else value

    def fields(self, a, field):
        pair = StructType([StructField("by", FIELD_TYPES[field[a.by].kind]),
                           StructField("value", FIELD_TYPES[field[a.column].kind])])
        return [StructField(_by(a), ArrayType(pair) if a.n else pair)]

    def shown_as_kept(self):
        return False

    def never_null(self, a, field):
        return a.n is not None

    def _newest(self, pairs: Column, a: Aggregate) -> Column:
        """The `n` pairs of the greatest (MAX_BY) or least (MIN_BY) ordering, that one first; ties to the greater
        value, so the list does not depend on row order."""
        return F.slice(F.sort_array(pairs, asc=self.function == "min_by"), 1, a.n)

    def _pick(self, pairs: Column) -> Column:
        # Ties to the greater value, so it does not depend on row order.
        return F.max(pairs) if self.function == "max_by" else F.min(pairs)

    @staticmethod
    def _pair(a: Aggregate) -> Column:
        # NULL when the ordering is: Spark's MIN_BY/MAX_BY skip such rows, as collect_list and MIN/MAX of NULL do.
        return F.when(F.col(a.by).isNotNull(), F.struct(F.col(a.by).alias("by"), F.col(a.column).alias("value")))

    def ranks(self, a, over, combining):
        # Over a window, every row of a partition holds the aggregate's value: a list of all its pairs would be
        # copied to each row and sorted there, n² in the rows of a key (a key with 20,000 events in one session
        # took seconds a batch). Each row is ranked instead, its pair (`combining`: the best pair of its list, a
        # list's best n coming from the n lists of the best pairs), and only the best n are collected.
        if not a.n:
            return {}
        best = ((F.array_max if self.function == "max_by" else F.array_min)(F.col(_by(a))) if combining
                else self._pair(a))
        order = best.desc_nulls_last() if self.function == "max_by" else best.asc_nulls_last()
        return {_rank(a): F.row_number().over(over.orderBy(order))}

    def partial(self, a, kinds, over=None):
        pair = self._pair(a)
        if a.n:
            return [self._newest(_over(F.collect_list(_best(a, pair, over)), over), a).alias(_by(a))]
        return [_over(self._pick(pair), over).alias(_by(a))]

    def of_row(self, a, kinds):
        # A list of its one pair, or none (flatten of a NULL list would make the combined list NULL).
        pair = self._pair(a)
        return [(F.filter(F.array(pair), lambda p: p.isNotNull()) if a.n else pair).alias(_by(a))]

    def combined(self, a, kinds, over=None):
        if a.n:
            return [self._newest(F.flatten(_over(F.collect_list(_best(a, F.col(_by(a)), over)), over)), a)
                    .alias(_by(a))]
        return [_over(self._pick(F.col(_by(a))), over).alias(_by(a))]

    def final(self, a, kinds):
        value = F.transform(_by(a), lambda p: p["value"]) if a.n else F.col(_by(a)).getField("value")
        return value.alias(a.name)

    def merged(self, a, types, field):
        c, pair = ident(a.name), ident(_by(a))
        pick = f"{'greatest' if self.function == 'max_by' else 'least'}(t.{pair}, s.{pair})"
        return [f"t.{c} = {pick}.value", f"t.{pair} = {pick}"]


KINDS: dict[str, AggregateKind] = {
    "count": _Count("Count", "row or column"),
    "sum": _Sum("Sum", "number"),
    "min": _Extreme("Min", "column", "min"),
    "max": _Extreme("Max", "column", "max"),
    "avg": _Avg("Avg", "number"),
    "min_by": _ExtremeBy("ArgMin", "value and ordering", "min_by"),
    "max_by": _ExtremeBy("ArgMax", "value and ordering", "max_by"),
}


def kind_of(a: Aggregate) -> AggregateKind:
    return KINDS[a.function]


def window_ranks(aggregates, over: WindowSpec, combining: bool = False) -> dict[str, Column]:
    """The columns `partial_columns` (`combining`: `combined_columns`) over the window `over` reads: added to the
    rows first."""
    return {name: c for a in aggregates for name, c in kind_of(a).ranks(a, over, combining).items()}


def partial_columns(aggregates, kinds: dict[str, str], over: WindowSpec | None = None) -> list[Column]:
    """Every aggregate's partial columns over rows of the stream (`over`: over that window, on each of its rows,
    which hold `window_ranks`' columns)."""
    return [c for a in aggregates for c in kind_of(a).partial(a, kinds, over)]


def row_columns(aggregates, kinds: dict[str, str]) -> list[Column]:
    """Every aggregate's partial columns of each row of the stream alone, in `partial_fields`' order."""
    return [c for a in aggregates for c in kind_of(a).of_row(a, kinds)]


def combined_columns(aggregates, kinds: dict[str, str], over: WindowSpec | None = None) -> list[Column]:
    """Every aggregate's partial columns over rows of partial columns (`over`: as `partial_columns`)."""
    return [c for a in aggregates for c in kind_of(a).combined(a, kinds, over)]


def partial_fields(aggregates, field: Fields) -> list[StructField]:
    return [f for a in aggregates for f in kind_of(a).fields(a, field)]


def final_column(a: Aggregate, kinds: dict[str, str]) -> Column:
    """The declared value of an aggregate, from its partial columns."""
    return kind_of(a).final(a, kinds)
