from ultratron.cli import main

raise SystemExit(main())
