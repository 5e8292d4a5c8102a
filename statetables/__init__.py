"""statetables: the Dagster code location (definitions), the command line, and the StateTables component."""


def __getattr__(name: str):
    # `type: statetables.StateTables` in a defs.yaml; imported on first use, so the command line starts without Dagster.
    if name == "StateTables":
        from statetables.component import StateTables

        return StateTables
    raise AttributeError(name)
