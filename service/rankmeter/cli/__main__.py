"""`python -m rankmeter.cli`, as `rankmeter`."""

from rankmeter.cli import main

raise SystemExit(main())
