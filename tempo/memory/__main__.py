"""``python -m tempo.memory``: the per-layer activation table (see tempo.bench.ledger_table)."""

from tempo.bench.ledger_table import main

raise SystemExit(main())
