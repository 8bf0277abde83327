"""``python -m mapl.planner``: when compression pays: time to target per link.

The command only; the code is :mod:`mapl.planning.planner`."""
import sys

from .base.cli import run_cli
from .planning.planner import main

if __name__ == "__main__":
    sys.exit(run_cli(main, prog="python -m mapl.planner"))
