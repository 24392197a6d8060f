from autofit.cli import main

raise SystemExit(main())
