"""``python -m specfork``: the ``specfork`` command (also what ``torchrun -m specfork`` runs)."""

import sys

from specfork.cli import main

sys.exit(main())
