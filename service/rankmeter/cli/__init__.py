"""The `rankmeter` command: `serve`, `demo`, `simulate`, `eval`, `report`, `replay`.

`command` holds the parser and `main`; each subcommand is a module (`serve`, `demo`,
`simulate`, `evaluate`, `report`, `replay`) that adds its parser and runs it; `common`
holds what they share: the errors `main` reports, the settings, reaching Redis and Kafka.
"""

from rankmeter.cli.command import main, parser

__all__ = ["main", "parser"]
