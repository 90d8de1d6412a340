"""``python3 -m purerl.model_check PATH`` (:mod:`purerl.model_check`)."""

import sys

from purerl.model_check.command import main

if __name__ == "__main__":
    sys.exit(main())
