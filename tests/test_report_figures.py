"""The report's figures: one palette, every figure titled with labelled axes and bars that say what they are,
labels that overlap nothing, deterministic bytes."""
import re

import numpy as np

from mapl import report as R
from tests.helpers.report_data import boxes_overlap, figure_texts, health_run, mini_rows


def test_style_map_distinct():
    colours = [c for c, _ in R.STYLE.values()]
    markers = [m for _, m in R.STYLE.values()]
    assert len(set(colours)) == len(colours) and len(set(markers)) == len(markers)
    assert set(R.METHOD_LABELS) <= set(R.STYLE) and set(R.FIGURE_LABELS) == set(R.STYLE)
    assert set(R.VARIANT_LABELS) | set(R.STUDY_VARIANT_LABELS) == set(R.STYLE)
    assert R.figure_label("none-anchor-factorized", 1.0) == "Uncompressed + anchors"      # an uncompressed arm: no ratio
    assert R.variant_label("ssn-anchor-factorized") == "ssn-anchor-factorized"             # tables keep the id
    assert R.label("mapl-rvq", 16, 8) == "MAPL+VQ 16× (proj. 8×)" and R.label("mapl", 8, 8) == "MAPL 8×"
    assert R.label("none", 1) == "Uncompressed"
    assert R.style("mapl-fixed-anchor-none")["markerfacecolor"] == "none"    # unknown: the method's, hollow
    assert [R.linestyle(x) for x in (1, 4, 8, 16, 32)] == ["-", "-", "--", ":", "-."]


def test_plots_write_pngs(rows, tmp_path):
    plots = [R.pareto_plot(rows), R.curves_plot(rows, "main"), R.curves_plot(rows, "long"),
             R.tokens_plot(rows, "t"), R.width_plot(rows, "w")]
    for p in plots:
        path = p.save(tmp_path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not p.empty and p.caption and p.takeaway
    assert "MAPL 8× 32 → 74.0" in plots[0].takeaway
    for p in (R.pareto_plot([]), R.curves_plot([], "long"), R.tokens_plot([], ""), R.width_plot([], "")):
        assert p.empty and p.save(tmp_path / "empty").exists()        # no runs: still a file (a DVC out)
    a, b = R.pareto_plot(rows).save(tmp_path / "a"), R.pareto_plot(rows).save(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()                            # deterministic bytes


def test_pareto_draws_one_setup_per_row_of_panels_each_titled_with_it(rows):
    """Two models at two budgets were one panel of lines told apart by line style; now each (model, P, budget) is
    a row of its own, the main model's first, and no panel holds another setup's points."""
    fig = R.pareto_plot(rows + mini_rows(rows)).figure
    titles = [ax.get_title().split("\n")[0] for ax in fig.axes]
    assert titles == ["tiny, P=4, 300 steps"] * 2 + ["mini, P=4, 1,000 steps"] * 2
    mini_fwd = {x for c in fig.axes[2].containers for x in c.lines[0].get_xdata()}
    assert mini_fwd == {256.0, 32.0}                                   # only mini's none and its 8x runs
    assert len(fig.axes[0].containers) == 5                            # tiny: none, int8, SSN, MAPL, MAPL+VQ
    assert "bars: ±1 sd over seeds" in figure_texts(fig)
    assert "bars: 95 % t interval of the mean" in figure_texts(R.pareto_plot(rows, "long").figure)


def test_the_scatter_keeps_the_main_model_and_numbers_every_cell(rows):
    scatter, alone = R.paper_scatter_plot(rows + mini_rows(rows)), R.paper_scatter_plot(rows)
    assert len(scatter.figure.axes[0].texts) == len(alone.figure.axes[0].texts)
    assert scatter.figure.axes[0].get_ylabel() == "our Δ val loss (%), tiny" and "(tiny;" in scatter.caption
    numbers = [t.get_text() for t in alone.figure.axes[0].texts]
    keyed = [t.get_text().split()[0] for t in alone.figure.legends[0].get_texts()][:len(numbers)]
    assert numbers == keyed == [str(i) for i in range(1, len(numbers) + 1)]


def test_point_labels_overlap_neither_each_other_nor_any_marker():
    """Ten cells in a cluster (the committed scatter's shape): every number sits clear of every other number and of
    every point, and each is nearer its own point than any other."""
    cells = [{"variant": v, "budget": b, "paper": p, "ours": o, "std": 0.3, "label": f"{v} {b}"}
             for v, b, p, o in (("ssn", "main", 8.4, 1.6), ("ssn", "main", 13.9, 2.6), ("mapl", "main", 0.8, 1.4),
                                ("mapl", "main", 1.3, 2.8), ("mapl-rvq", "main", 1.1, 1.9), ("mapl-rvq", "main", 3.0, 3.3),
                                ("ssn", "long", 13.9, 2.8), ("mapl", "long", 1.4, 1.2),
                                ("mapl-fixed", "long", 1.1, 1.4), ("mapl-rvq-scaled", "long", 3.0, 1.45))]
    fig = R.paper_scatter_figure(cells, "tiny")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    points = ax.transData.transform([(c["paper"], c["ours"]) for c in cells])
    assert len(labels) == len(cells)
    for i, a in enumerate(labels):
        assert not any(boxes_overlap(a, b) for b in labels[i + 1:]), ax.texts[i].get_text()
        centre = np.array([(a.x0 + a.x1) / 2, (a.y0 + a.y1) / 2])
        nearest = int(np.argmin(np.linalg.norm(points - centre, axis=1)))
        assert nearest == i, f"label {i + 1} sits nearest point {nearest + 1}"
        for x, y in points:
            assert not (a.x0 < x < a.x1 and a.y0 < y < a.y1), f"label {i + 1} covers a point"
    placed = [t.get_window_extent(renderer) for t in R.paper_scatter_figure(cells, "tiny").axes[0].texts]
    assert [tuple(b.bounds) for b in placed] == [tuple(b.bounds) for b in labels]            # deterministic


def test_health_draws_small_multiples_with_the_legend_outside_every_panel():
    """Was one panel per boundary holding every run, with a legend of ~65 entries over the last panel and off the
    figure. Now: a row per configuration, a column per boundary, seeds as thin lines of the row's one colour, and
    a legend of two entries below every panel."""
    runs = [health_run(v, w, s, warn=150 if (v, s) == ("ssn", 1) else None)
            for v, w in (("none", 1.0), ("ssn", 8.0), ("mapl", 4.0), ("mapl", 8.0), ("mapl-fixed", 8.0)) for s in range(8)]
    fig = R.health_figure(runs, "Boundary health")
    grid = np.array(fig.axes).reshape(5, 3)
    assert [ax.get_title() for ax in grid[0]] == ["boundary 0", "boundary 1", "boundary 2"]
    rows = [ax.get_ylabel().rsplit("\n", 1)[0].replace("\n", " ") for ax in grid[:, 0]]      # less "(8 seeds)"
    assert rows == ["Uncompressed", "SSN 8×", "MAPL 4×", "MAPL 8×", "MAPL, fixed projector 8×"]
    for row, variant in zip(grid, ("none", "ssn", "mapl", "mapl", "mapl-fixed")):
        for ax in row:
            seeds = [ln for ln in ax.get_lines() if ln.get_marker() in ("None", "", None)]
            assert len(seeds) == 8 and {ln.get_color() for ln in seeds} == {R.colour(variant)}
            assert all(ln.get_linewidth() < 1 for ln in seeds)
    assert sum(len(ax.get_lines()) - 8 for ax in grid[1]) == 3             # the warning's tick, one per boundary
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,), frame = fig.legends, fig.bbox
    box = legend.get_window_extent(renderer)
    assert len(legend.get_texts()) == 2 and frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
    assert not any(boxes_overlap(box, ax.get_window_extent(renderer)) for ax in fig.axes)


def test_every_figure_has_a_title_labelled_axes_and_bars_that_say_what_they_are(rows, tmp_path):
    """Each report figure on the synthetic tree: a title, every drawn panel's axes labelled (a shared axis once per
    row or column), and wherever an error bar or a band is drawn, the figure says whether it is the sd, a 95 %
    interval or the seeds' range."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer
    health = [health_run("mapl", 8.0, s) for s in range(2)]
    plots = [R.pareto_plot(rows), R.pareto_plot(rows, "long"), R.curves_plot(rows, "main"), R.curves_plot(rows, "long"),
             R.tokens_plot(rows, "t"), R.tokens_plot(rows, "t", best=True), R.width_plot(rows, "w"),
             R.gap_curves_plot(rows), R.paper_scatter_plot(rows), R.controls_plot(rows)]
    figures = [p.figure for p in plots if not p.empty] + [R.health_figure(health, "h"),
                                                          R.token_length_figure({1: 5, 2: 9})]
    for fig in figures:
        text = figure_texts(fig)
        drawn = [ax for ax in fig.axes if ax.get_lines() or ax.collections or ax.patches]
        assert fig.get_suptitle() or all(ax.get_title() for ax in drawn), text[:80]
        assert any(ax.get_xlabel() for ax in drawn) and (fig._supylabel or any(ax.get_ylabel() for ax in drawn)), text[:80]
        bars = any(isinstance(c, ErrorbarContainer) and (c.has_yerr or c.has_xerr) for ax in drawn for c in ax.containers)
        bands = any(isinstance(c, PolyCollection) for ax in drawn for c in ax.collections)
        if bars:
            assert re.search(r"±1 sd|95 % t interval|Holm-adjusted", text), text[:200]
        if bands:
            assert re.search(r"band: (min–max|95 %)", text), text[:200]


def test_every_variant_the_results_hold_has_a_style_and_a_name():
    """Every method of the config and every variant in the committed cpu results has a colour, a marker and a
    display name of its own (a variant without one would be drawn hollow in its method's colour, named by its id)."""
    from pathlib import Path
    from mapl.core.config import METHODS
    results = Path(__file__).resolve().parents[1] / "reports" / "cpu" / "results"
    variants = {r["variant"] for r in R.load_results(results.parents[2], results)} if results.is_dir() else set()
    for v in set(METHODS) | variants:
        assert v in R.STYLE and v in R.FIGURE_LABELS, v
    assert set(R.PROJECTOR_VARIANTS) == set(R.PROJECTOR_LABELS) and set(R.PROJECTOR_VARIANTS.values()) <= set(R.STYLE)


# a colour written into drawing code: a hex literal, or a quoted value for a colour keyword ("none" is no colour)


_COLOUR_LITERAL = re.compile(r"#[0-9a-fA-F]{6}\b|\b(?:color|colors|colour|facecolor|edgecolor|mfc|mec|markerfacecolor|"
                             r"markeredgecolor|cmap)\s*=\s*(['\"])(?!none\1)")


def test_no_colour_is_written_outside_the_style_module():
    """The report's and the planner's figures take every colour from mapl.report.style."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "mapl"
    sources = sorted((root / "report").glob("*.py")) + sorted((root / "planning").glob("*.py"))
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sources if p.name != "style.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if _COLOUR_LITERAL.search(line)]
    assert not found, "\n".join(found)
    assert _COLOUR_LITERAL.search('ax.plot(x, color="0.3")') and _COLOUR_LITERAL.search("c = '#1f77b4'")
    assert not _COLOUR_LITERAL.search('ax.plot(x, markerfacecolor="none")')


def test_the_planner_figures_name_and_colour_methods_as_the_report_does():
    from mapl.planning.planner_views import curve_figure, display_name, heatmap_figure
    curves = {"none": ([2.0, 1.0], [2.0, 1.0], [2.0, 1.0]), "mapl-rvq 16x": ([1.0, 1.5], [1.0, 1.5], [1.0, 1.5])}
    fig = curve_figure(curves, [1e6, 1e7], 0.1, {"mapl-rvq 16x": [3e6]})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["Uncompressed", "MAPL+VQ 16×"] and display_name("mapl 8x") == "MAPL 8×"
    assert [ln.get_color() for ln in ax.get_lines()[:2]] == [R.colour("none"), R.colour("mapl-rvq")]
    assert "band: steps-to-target range, step time ±10 %" in labels and ax.get_xlabel().startswith("link bandwidth")
    heat = heatmap_figure({"none": [[1.0, 1.0]], "ssn 8x": [[1.1, 0.9]]}, [1e6, 1e7], [0.0])
    assert heat.axes[0].get_title() == "SSN 8×" and heat.axes[0].get_title() != ""
    assert heat.get_suptitle().startswith("Speedup of time to target over Uncompressed")
