"""``python -m mapl.costmodel``: GPU-hour and wall-clock estimate of a profile's runs.

The command only; the code is :mod:`mapl.planning.costmodel`."""
import sys

from .base.cli import run_cli
from .planning.costmodel import main

if __name__ == "__main__":
    sys.exit(run_cli(main, prog="python -m mapl.costmodel"))
