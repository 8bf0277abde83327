"""``python -m mapl.reuse``: the training-code fingerprint and the files it covers.

The command only; the code is :mod:`mapl.orchestration.reuse`."""
import sys

from .orchestration.reuse import main

if __name__ == "__main__":
    sys.exit(main())
