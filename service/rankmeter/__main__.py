from rankmeter.cli import main

raise SystemExit(main())
