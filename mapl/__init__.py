"""mapl: learned subspace compression of pipeline-parallel stage boundaries (MAPL) and its baselines.

    mapl data --profile cpu          # prepare the corpus and tokenizer
    mapl train --profile cpu --method mapl --ratio 8
    mapl --help                      # every command, one line each
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
