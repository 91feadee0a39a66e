from kvroom.cli import main

raise SystemExit(main())
