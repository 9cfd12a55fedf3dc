import sys

from tempo.movement.cli import main

sys.exit(main())
