"""``python -m specfork.cli``: the ``specfork`` command without the installed script."""

import sys

from specfork.cli import main

sys.exit(main())
