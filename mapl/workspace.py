"""``python -m mapl.workspace``: a copy of the artifact to run a profile in.

The command only; the code is :mod:`mapl.orchestration.workspace`."""
import sys

from .orchestration.workspace import main

if __name__ == "__main__":
    sys.exit(main())
