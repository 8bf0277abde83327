"""``python -m mapl.memory``: the memory plan per stage.

The command only; the code is :mod:`mapl.core.memory`."""
import sys

from .core.memory import main

if __name__ == "__main__":
    sys.exit(main())
