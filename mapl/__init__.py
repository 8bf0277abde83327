"""mapl: learned subspace compression of pipeline-parallel stage boundaries (MAPL) and its baselines.

    python -m mapl.data --profile cpu          # prepare the corpus and tokenizer
    python -m mapl.train --profile cpu --method mapl --ratio 8
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
