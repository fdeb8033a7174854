from epkit.cli import main

raise SystemExit(main())
