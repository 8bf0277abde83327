"""mapl: learned subspace compression of pipeline-parallel stage boundaries (MAPL) and its baselines.

    mapl data --profile cpu          # prepare the corpus and tokenizer
    mapl train --profile cpu --method mapl --ratio 8
    mapl --help                      # every command, one line each
"""
from .base.legacy_commands import install as _install_legacy_commands

__version__ = "0.1.0"
__all__ = ["__version__"]

_install_legacy_commands()           # `python -m mapl.train` and the other old spellings, for one release
