"""``python -m mapl.peer``: the peer systems' cost on our link model.

The command only; the code is :mod:`mapl.planning.peer`."""
import sys

from .planning.peer import main

if __name__ == "__main__":
    sys.exit(main())
