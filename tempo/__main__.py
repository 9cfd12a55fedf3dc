"""`python -m tempo`: the main job (see tempo/demo.py)."""

from tempo.demo import main

raise SystemExit(main())
