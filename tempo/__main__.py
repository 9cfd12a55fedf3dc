"""`python -m tempo`: the main job (see tempo/tasks/demo.py)."""

from tempo.tasks.demo import main

raise SystemExit(main())
