"""``python -m streamflow`` = the ``streamflow`` console script (streamflow.cli.main)."""

from streamflow.cli import main

raise SystemExit(main())
