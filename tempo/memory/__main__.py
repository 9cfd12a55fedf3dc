"""``python -m tempo.memory``: the activation-ledger tables, counted on fake tensors (see tempo.bench.ledger_table)."""

from tempo.bench.ledger_table import main

raise SystemExit(main())
