"""Results JSON -> the report: tables (Markdown, CSV, LaTeX), figures, metrics and LaTeX macros,
each table and figure with a caption and a takeaway computed from its numbers.

The logic behind ``notebooks/report.ipynb``::

    >>> from mapl import report
    >>> paths = report.output_paths(ROOT, "cpu")                    # reports/cpu/{results,tables,...}
    >>> rows = report.select(report.load_results(ROOT, paths["results"]), profile="cpu")
    >>> report.write_table(report.headline_table(rows), paths["tables"])
    >>> report.pareto_plot(rows).save(paths["figures"])

Modules: :mod:`~mapl.report.rows` (the row schema, loading, selection, budgets),
:mod:`~mapl.report.stats` (Δ%, summaries over seeds, paired t-intervals),
:mod:`~mapl.report.paper` (the paper's numbers, from ``reports/paper-numbers.csv``),
:mod:`~mapl.report.style` (display names, one colour and marker per method, what error bars show; the
planner's figures use it too), :mod:`~mapl.report.table`
(the Table type and its writers), :mod:`~mapl.report.tables` (main-budget tables),
:mod:`~mapl.report.studies` (headline with paired comparisons, token and width axes),
:mod:`~mapl.report.controls` (issue 26's studies: the decomposition, learned vs fixed at 4x, the corpus, blocks),
:mod:`~mapl.report.ladder` (the scale ladder: the gap per rung and its slope in ln(parameters)),
:mod:`~mapl.report.claims` (the claims ledger), :mod:`~mapl.report.heldout` (finished runs rescored on
windows no choice saw, and whether a verdict moves), :mod:`~mapl.report.exhibits` (the exhibits a reviewer reads
first: the primary contrast per seed, learned against fixed, where the order holds),
:mod:`~mapl.report.figures` and :mod:`~mapl.report.plots` (drawing; captions and takeaways),
:mod:`~mapl.report.ttt` (time to target on a simulated link), :mod:`~mapl.report.metrics`
(metrics.json and macros), :mod:`~mapl.report.render` (the notebook's glue) and
:mod:`~mapl.report.data_stats` (corpus statistics for the data notebook).

Two ratios, never confused: ``wire_ratio`` = 2d / forward bytes per token (what the results JSON
call ``ratio``) and ``projection_ratio`` = d / r (the config's ``compressor.ratio``); MAPL+VQ at
projection 8x is 16x on the wire. Every table says which it shows.
"""
import sys

from .claims import *
from .controls import *
from .data_stats import *
from .exhibits import *
from .figures import *
from .frozen import *
from .heldout import *
from .ladder import *
from .metrics import *
from .paper import *
from .plots import *
from .render import *
from .rows import *
from .stats import *
from .studies import *
from .style import *
from .table import *
from .tables import *
from .ttt import *

# (the functions ``metrics`` and ``style`` shadow their modules here: read the modules from sys.modules)
_MODULES = ("rows", "stats", "paper", "style", "table", "tables", "studies", "controls", "frozen", "heldout", "ladder",
            "claims",
            "exhibits", "figures",
            "plots", "ttt", "metrics", "render", "data_stats")
__all__ = [name for mod in _MODULES for name in sys.modules[f"{__name__}.{mod}"].__all__]
