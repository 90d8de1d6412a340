"""``python3 -m purerl.report RUN_DIR [-o FILE]``: see :mod:`purerl.report`."""

import sys

from purerl.report import main

sys.exit(main())
