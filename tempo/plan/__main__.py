"""``python -m tempo.plan``: the command lives with the benchmarks (it builds models); see tempo/bench/plan_cli.py."""

from tempo.bench.plan_cli import main

raise SystemExit(main())
