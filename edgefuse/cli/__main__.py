"""``python -m edgefuse.cli ARGS`` = ``edgefuse ARGS``."""

import sys

from edgefuse.cli.main import main

sys.exit(main())
