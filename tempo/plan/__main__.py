"""``python -m tempo.plan``: see tempo/plan/cli.py."""

from tempo.plan.cli import main

raise SystemExit(main())
