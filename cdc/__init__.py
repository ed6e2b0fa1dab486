"""Change data capture: the WAL of the captured Postgres tables as `cdc.<table>` changelogs."""
