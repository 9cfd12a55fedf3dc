"""``python -m tempo.memory``: the activation-ledger tables, counted on fake tensors (see tempo/memory/cli.py)."""

from tempo.memory.cli import main

raise SystemExit(main())
