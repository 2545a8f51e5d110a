"""``python -m wan_diloco.cli``: the same as the ``wan-diloco`` command (the launcher starts children so)."""
import sys

from wan_diloco.cli import main

sys.exit(main())
