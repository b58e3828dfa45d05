"""``narwhal bench report``: an admission benchmark run as one self-contained HTML page.

It reads the JSON that ``narwhal bench admission --output FILE`` writes (one file or several:
seeds, traces; one section each) and renders, per file, the run's settings, the verdicts (a
check that did not run shows as ``NOT RUN``), a table of the runs and PNG plots embedded as
``data:`` URIs, so the page has no external resources:

* goodput in engine work against load, with the bound (and predictive's bound with the budget
  as a deadline), for every mode and baseline;
* the in-budget share of admitted requests against load;
* TTFT CDFs, one panel per load, a line per mode;
* the prediction error over time (predictive mode): the projection at arrival, which admission
  decides on, and the prediction at placement;
* the safety factor and each engine's drift ratios over time (predictive mode).

The last three need the per-request and sampled series a run records
(:func:`narwhal.bench.goodput.request_series`, the replay's sampler); a JSON written before
they were recorded still renders, those plots marked as not recorded.

The plots are drawn with matplotlib's Agg canvas (no display, no global backend state), which
the ``bench`` extra installs. Everything read from the JSON is checked for its type where it is
used: a value of the wrong kind is left out, it does not stop the page.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["NOT_RECORDED", "ReportError", "load_reports", "render_html", "write_report"]

NOT_RECORDED = "not recorded in this run"
"""What a plot whose series the JSON lacks says instead (an older run)."""

_MODE_ORDER = ("predictive", "shadow", "open", "queue-cap", "engine-cap")
_COLOURS = {
    "predictive": "#1f77b4",
    "shadow": "#9467bd",
    "open": "#ff7f0e",
    "queue-cap": "#2ca02c",
    "engine-cap": "#d62728",
}
_CDF_POINTS = 2000  # points drawn per CDF line: plenty for the eye, light in the PNG
_ERROR_LIMITS = (-1.0, 2.0)  # the error axis; errors beyond are drawn on its edge
_DPI = 90


class ReportError(Exception):
    """A JSON file that cannot be read as an admission benchmark run."""


def load_reports(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Read one ``narwhal bench admission --output`` JSON: its report, named by the file, or
    (a run with ``--seeds``) each seed's, named by the file and the seed.

    Raises:
        ReportError: the file cannot be read, is not JSON, or is not an admission run (an object
            with a ``runs`` list, or a ``by_seed`` list of such objects).
    """
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except orjson.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from exc
    if isinstance(data, dict) and isinstance(data.get("by_seed"), list):
        seeds = data.get("seeds")
        reports = data["by_seed"]
        if not isinstance(seeds, list) or len(seeds) != len(reports):
            seeds = list(range(len(reports)))
        if reports and all(_is_run(report) for report in reports):
            return [
                (f"{path.name}, seed {seed}", report)
                for seed, report in zip(seeds, reports, strict=True)
            ]
    elif _is_run(data):
        return [(path.name, data)]
    raise ReportError(
        f"{path}: not an admission benchmark run (no 'runs' list; write one with "
        "`narwhal bench admission --output FILE`)"
    )


def _is_run(data: object) -> bool:
    return isinstance(data, dict) and isinstance(data.get("runs"), list)


def write_report(inputs: Sequence[Path], output: Path) -> int:
    """Render ``inputs`` into ``output``; return the bytes written.

    Raises:
        ReportError: an input is not an admission run, or matplotlib is not installed (nothing
            is written).
        OSError: ``output`` cannot be written.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ReportError("the plots need matplotlib: pip install 'narwhal[bench]'") from exc
    runs = [section for path in inputs for section in load_reports(path)]
    page = render_html(runs).encode()
    output.write_bytes(page)
    return len(page)


def render_html(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The page: one section per ``(name, JSON report)``."""
    sections = [_section(number, name, report) for number, (name, report) in enumerate(reports)]
    contents = "".join(
        f'<li><a href="#run-{number}">{_e(_title(name, report))}</a></li>'
        for number, (name, report) in enumerate(reports)
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        "<title>Narwhal admission benchmark report</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>Narwhal admission benchmark</h1>"
        f"<ul class=contents>{contents}</ul>" + "".join(sections) + "</body></html>\n"
    )


_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0 1em}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;font-size:0.9em}"
    "th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    ".PASS{background:#d7f5d7}.FAIL{background:#f8d0d0}.NOT-RUN{background:#eee;color:#666}"
    ".INCOMPLETE{background:#fbeec8}.missing{color:#8a5a00;font-style:italic}"
    "img{max-width:100%}pre{background:#f7f7f7;padding:0.5em;overflow:auto;font-size:0.8em}"
    "section{border-top:2px solid #444;margin-top:2em}"
)


# -- reading the JSON, leniently ----------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: object) -> float | None:
    """A finite number, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _numbers(value: object) -> list[float]:
    return [number for item in _list(value) if (number := _num(item)) is not None]


def _runs(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The runs that have a load and a mode."""
    return [
        run
        for run in map(_map, _list(report.get("runs")))
        if _num(run.get("load")) is not None and isinstance(run.get("mode"), str)
    ]


def _modes(report: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The modes of ``runs``: in the settings' order, then the usual order, then any other."""
    present = {run["mode"] for run in runs}
    listed = [m for m in _list(_map(report.get("settings")).get("modes")) if isinstance(m, str)]
    order = [*listed, *_MODE_ORDER, *sorted(present)]
    return [mode for mode in dict.fromkeys(order) if mode in present]


def _loads(runs: Iterable[Mapping[str, Any]]) -> list[float]:
    return sorted({float(run["load"]) for run in runs})


def _colour(mode: str) -> str:
    return _COLOURS.get(mode, "#7f7f7f")


def _title(name: str, report: Mapping[str, Any]) -> str:
    settings = _map(report.get("settings"))
    parts = [name]
    if isinstance(settings.get("trace"), str):
        parts.append(f"trace {settings['trace']}")
    seed = settings.get("seed")
    if _num(seed) is not None and not name.endswith(f", seed {seed}"):  # a --seeds section
        parts.append(f"seed {seed}")
    verdict = report.get("verdict")
    return ", ".join(parts) + (f": {verdict}" if isinstance(verdict, str) else "")


def _pct(value: object) -> str:
    number = _num(value)
    return "n/a" if number is None else f"{number * 100:.1f} %"


def _fmt(value: object, digits: int = 2) -> str:
    number = _num(value)
    return "n/a" if number is None else f"{number:.{digits}f}"


# -- the page's parts ---------------------------------------------------------------------------


def _section(number: int, name: str, report: Mapping[str, Any]) -> str:
    runs = _runs(report)
    parts = [
        f'<section id="run-{number}"><h2>{_e(_title(name, report))}</h2>',
        _verdicts(report),
        _settings(report),
        _runs_table(report, runs),
        "<h3>Goodput against load</h3>",
        _goodput_plot(report, runs),
        "<h3>In-budget share against load</h3>",
        _in_budget_plot(report, runs),
        "<h3>TTFT CDFs</h3>",
        _ttft_plot(report, runs),
        "<h3>Prediction error over time (predictive)</h3>",
        _prediction_plot(runs),
        "<h3>Safety factor and engine drift over time (predictive)</h3>",
        _router_plot(runs),
        "</section>",
    ]
    return "".join(parts)


def _missing(what: str) -> str:
    return f'<p class="missing">{_e(what)}: {NOT_RECORDED}.</p>'


def _verdicts(report: Mapping[str, Any]) -> str:
    checks = [_map(check) for check in _list(report.get("checks"))]
    verdict = report.get("verdict")
    head = (
        f'<p>Verdict: <span class="{_e(str(verdict).replace(" ", "-"))}">'
        f"<b>{_e(verdict)}</b></span></p>"
        if isinstance(verdict, str)
        else ""
    )
    if not checks:
        return "<h3>Verdicts</h3>" + head + _missing("verdicts")
    rows = []
    for check in checks:
        shown = check.get("verdict")
        if not isinstance(shown, str):
            passed = check.get("passed")
            shown = "NOT RUN" if passed is None else ("PASS" if passed is True else "FAIL")
        rows.append(
            f"<tr><td>{_e(check.get('name', '?'))}</td><td class=n>{_e(check.get('measured', ''))}"
            f"</td><td class=n>{_e(check.get('target', ''))}</td>"
            f"<td class=n>{_e(check.get('open_mode') or '-')}</td>"
            f'<td class="{_e(shown.replace(" ", "-"))}">{_e(shown)}</td>'
            f"<td>{_e(check.get('note') or '')}</td></tr>"
        )
    return (
        "<h3>Verdicts</h3>"
        + head
        + "<table><tr><th>check</th><th>measured</th><th>target</th><th>open</th>"
        "<th>verdict</th><th>note</th></tr>" + "".join(rows) + "</table>"
    )


_SETTINGS_SHOWN = (
    ("trace", "trace"),
    ("duration_s", "trace seconds replayed"),
    ("seed", "seed"),
    ("profile", "router's profile"),
    ("engines", "engines"),
    ("engine_profiles", "engine profiles"),
    ("engine_truth", "engines' truth"),
    ("budget_s", "TTFT budget (s)"),
    ("loads", "loads"),
    ("modes", "modes"),
    ("baselines", "baselines"),
    ("tokens_per_chunk", "tokens per chunk"),
    ("time_scale", "time scale (real time)"),
    ("jobs", "worker processes"),
)


def _settings(report: Mapping[str, Any]) -> str:
    settings = _map(report.get("settings"))
    rows = [
        f"<tr><th>{_e(label)}</th><td>{_e(_compact(settings[key]))}</td></tr>"
        for key, label in _SETTINGS_SHOWN
        if key in settings
    ]
    capacity = _map(report.get("capacity"))
    if capacity:
        ceiling = capacity.get("ceiling", capacity.get("engine_s_per_s"))
        busy = capacity.get("busy_s_per_s")
        ledger = "" if _num(busy) is None else f", busy {_fmt(busy, 3)}"
        rows.append(
            f"<tr><th>capacity</th><td>{_fmt(ceiling, 3)} engine-s/s (the engines' count"
            f"{ledger}, {_fmt(capacity.get('engine_s_per_s'), 3)} charged saturated), "
            f"{_fmt(capacity.get('rps'))} req/s, noise {_pct(capacity.get('noise'))}"
            f"{'' if capacity.get('measured', True) else ' (given)'}</td></tr>"
        )
    wall = report.get("wall_s")
    if isinstance(wall, Mapping):
        text = ", ".join(f"{key} {_fmt(value, 0)} s" for key, value in wall.items())
        rows.append(f"<tr><th>wall time</th><td>{_e(text)}</td></tr>")
    elif _num(wall) is not None:
        rows.append(f"<tr><th>wall time</th><td>{_fmt(wall, 0)} s</td></tr>")
    environment = _map(report.get("environment"))
    if environment:
        rows.append(f"<tr><th>environment</th><td>{_e(_compact(environment))}</td></tr>")
    full = orjson.dumps(settings, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    return (
        "<h3>Settings</h3><table>"
        + "".join(rows)
        + "</table><details><summary>every setting</summary>"
        + f"<pre>{_e(full)}</pre></details>"
    )


def _compact(value: object) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _runs_table(report: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    if not runs:
        return "<h3>Runs</h3>" + _missing("runs")
    modes = _modes(report, runs)
    ordered = sorted(runs, key=lambda run: (float(run["load"]), modes.index(run["mode"])))
    rows = []
    for run in ordered:
        false = _map(run.get("false_refusals"))
        sampled = _list(false.get("sampled"))
        # Reports written before the displacement was measured counted those met the budget.
        false_ones = _list(false.get("false", false.get("met_budget")))
        false_text = f"{len(false_ones)}/{len(sampled)}" if false else "-"
        projection = _map(run.get("projection_error"))
        rows.append(
            f"<tr><td class=n>{float(run['load']):g}x</td><td>{_e(run['mode'])}</td>"
            f"<td class=n>{_e(run.get('offered', ''))}</td>"
            f"<td class=n>{_pct(run.get('admitted_fraction'))}</td>"
            f"<td class=n>{_pct(run.get('in_budget_fraction'))}</td>"
            f"<td class=n>{_pct(run.get('goodput_engine_ratio'))}</td>"
            f"<td class=n>{_pct(run.get('goodput_ratio'))}</td>"
            f"<td class=n>{_fmt(run.get('ttft_p50_s'))}</td>"
            f"<td class=n>{_fmt(run.get('ttft_p99_s'))}</td>"
            f"<td class=n>{false_text}</td>"
            f"<td class=n>{_pct(projection.get('median_abs'))} / "
            f"{_pct(projection.get('p90_abs'))}</td></tr>"
        )
    return (
        "<h3>Runs</h3><table><tr><th>load</th><th>mode</th><th>offered</th><th>admitted</th>"
        "<th>in budget</th><th>goodput / bound (engine work)</th><th>(requests)</th>"
        "<th>TTFT p50 s</th><th>p99 s</th><th>false refusals</th>"
        "<th>arrival projection error median / p90</th></tr>" + "".join(rows) + "</table>"
    )


# -- plots --------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _image(figure: Figure, alt: str) -> str:
    """The figure as an ``<img>`` with its PNG inline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # Agg draws it: no display, no global backend
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _by_mode(
    runs: Sequence[Mapping[str, Any]], modes: Sequence[str], key: str
) -> dict[str, tuple[list[float], list[float]]]:
    """For each mode, its loads and the runs' ``key`` (runs without it left out)."""
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for mode in modes:
        points = sorted(
            (float(run["load"]), value)
            for run in runs
            if run["mode"] == mode and (value := _num(run.get(key))) is not None
        )
        if points:
            lines[mode] = ([load for load, _ in points], [value for _, value in points])
    return lines


def _legend(axes: Axes, fontsize: str = "small", markerscale: float = 1.0) -> None:
    """A legend, where something drawn has a label (matplotlib warns of an empty one)."""
    handles, _ = axes.get_legend_handles_labels()
    if handles:
        axes.legend(fontsize=fontsize, markerscale=markerscale)


def _load_axis(axes: Axes, loads: Sequence[float]) -> None:
    axes.set_xlabel("offered load (x capacity)")
    axes.set_xticks(list(loads))
    axes.set_xticklabels([f"{load:g}x" for load in loads])
    axes.grid(True, alpha=0.3)


def _bar(report: Mapping[str, Any]) -> Mapping[str, Any]:
    return _map(_map(report.get("settings")).get("bar"))


def _goodput_plot(report: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    modes = _modes(report, runs)
    absolute = _by_mode(runs, modes, "goodput_engine_s_per_s")
    ratios = _by_mode(runs, modes, "goodput_engine_ratio")
    if not absolute:
        return _missing("goodput in engine work")
    loads = _loads(runs)
    bound = _bound_by_load(runs, "bound_engine_s_per_s")
    # Each predictive run's own bound with the budget as a deadline (not a verdict's).
    predictive = [run for run in runs if run.get("mode") == "predictive"]
    deadline = _bound_by_load(predictive, "deadline_bound_engine_s_per_s")
    figure = _figure(11, 3.8)
    left, right = figure.subplots(1, 2)
    for points, style, label in (
        (bound, "--", "bound: min(offered, capacity)"),
        (deadline, ":", "bound with the budget as a deadline"),
    ):
        if points:
            left.plot(
                [load for load, _ in points],
                [value for _, value in points],
                color="black",
                linestyle=style,
                label=label,
            )
    for mode, (xs, ys) in absolute.items():
        left.plot(xs, ys, marker="o", color=_colour(mode), label=mode)
    left.set_ylabel("goodput in budget (engine-s/s)")
    left.set_ylim(bottom=0)
    _load_axis(left, loads)
    _legend(left, fontsize="small")
    for mode, (xs, ys) in ratios.items():
        right.plot(xs, [y * 100 for y in ys], marker="o", color=_colour(mode), label=mode)
    right.axhline(100, color="black", linestyle="--", linewidth=1, label="bound")
    target = _num(_bar(report).get("goodput_ratio"))
    if target is not None:
        right.axhline(target * 100, color="grey", linestyle=":", label="target")
    right.set_ylabel("goodput / bound, engine work (%)")
    right.set_ylim(bottom=0)
    _load_axis(right, loads)
    _legend(right, fontsize="small")
    return _image(figure, "goodput in engine work against load") + (
        "<p>Goodput: the engine time the simulator's step ledger charged to the requests "
        "completed inside the TTFT budget, per second of the measurement window; the bound is "
        "min(offered, capacity) of the attainable requests in the same unit, the capacity being "
        "the engines' count (an engine is busy at most all the time), so goodput cannot pass "
        "it."
        + (
            " The dotted line is predictive's bound with the budget as a deadline (not a "
            "verdict's): every request in budget has its prefill done within its own budget "
            "window, so a burst no pool can prefill in time cannot all count."
            if deadline
            else ""
        )
        + "</p>"
    )


def _bound_by_load(runs: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """The largest ``key`` of the runs at each load, by load (runs without it left out)."""
    values: dict[float, list[float]] = {}
    for run in runs:
        value = _num(run.get(key))
        if value is not None:
            values.setdefault(float(run["load"]), []).append(value)
    return sorted((load, max(found)) for load, found in values.items())


def _in_budget_plot(report: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    modes = _modes(report, runs)
    shares = _by_mode(runs, modes, "in_budget_fraction")
    if not shares:
        return _missing("in-budget share")
    figure = _figure(7, 3.6)
    axes = figure.subplots()
    for mode, (xs, ys) in shares.items():
        axes.plot(xs, [y * 100 for y in ys], marker="o", color=_colour(mode), label=mode)
    bar = _bar(report)
    target = _num(bar.get("in_budget_fraction"))
    at = _numbers(bar.get("in_budget_loads"))
    if target is not None and at:
        axes.plot(
            at, [target * 100] * len(at), "k_", markersize=20, linestyle="none", label="target"
        )
    axes.set_ylabel("admitted requests in budget (%)")
    axes.set_ylim(0, 101)
    _load_axis(axes, _loads(runs))
    _legend(axes, fontsize="small")
    return _image(figure, "in-budget share against load")


def _series(run: Mapping[str, Any]) -> Mapping[str, Any]:
    return _map(run.get("series"))


def _grid(count: int) -> tuple[int, int]:
    columns = min(count, 4)
    return -(-count // columns), columns


def _panels(figure: Figure, count: int) -> list[Axes]:
    rows, columns = _grid(count)
    axes = figure.subplots(rows, columns, squeeze=False)
    panels = [axes[row][column] for row in range(rows) for column in range(columns)]
    for unused in panels[count:]:
        unused.set_visible(False)
    return panels[:count]


def _thin(values: Sequence[float], points: int) -> list[float]:
    """At most ``points`` of sorted ``values``, evenly spread, the last kept."""
    if len(values) <= points:
        return list(values)
    step = (len(values) - 1) / (points - 1)
    return [values[round(i * step)] for i in range(points)]


def _ttft_plot(report: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    modes = _modes(report, runs)
    recorded = [run for run in runs if isinstance(_series(run).get("ttft_s"), list)]
    if not recorded:
        return _missing("per-request TTFTs")
    loads = _loads(recorded)
    budget = _num(_map(report.get("settings")).get("budget_s"))
    rows, _ = _grid(len(loads))
    figure = _figure(11, 2.9 * rows + 0.4)
    for axes, load in zip(_panels(figure, len(loads)), loads, strict=True):
        for mode in modes:
            run = next((r for r in recorded if r["mode"] == mode and r["load"] == load), None)
            if run is None:
                continue
            ttfts = sorted(_numbers(_series(run)["ttft_s"]))
            if not ttfts:
                continue
            shown = _thin(ttfts, _CDF_POINTS)
            share = [(i + 1) / len(shown) for i in range(len(shown))]
            axes.step(shown, share, where="post", color=_colour(mode), label=mode)
        if budget is not None:
            axes.axvline(budget, color="black", linestyle="--", linewidth=1, label="budget")
        axes.set_xscale("log")
        axes.set_title(f"{load:g}x")
        axes.set_xlabel("TTFT (s)")
        axes.set_ylabel("share of admitted")
        axes.set_ylim(0, 1.01)
        axes.grid(True, alpha=0.3)
        _legend(axes, fontsize="x-small")
    return _image(figure, "TTFT CDFs per load and mode") + (
        "<p>The TTFTs of the admitted requests that got a first output, per load; a "
        "request refused or never answered is not in its mode's curve.</p>"
    )


def _predictive(runs: Sequence[Mapping[str, Any]], part: str) -> list[Mapping[str, Any]]:
    """The predictive runs, by load, that recorded ``part`` of their series."""
    chosen = [run for run in runs if run["mode"] == "predictive"]
    return sorted(
        (run for run in chosen if isinstance(_series(run).get(part), Mapping)),
        key=lambda run: float(run["load"]),
    )


def _clipped(values: Iterable[object]) -> list[float]:
    low, high = _ERROR_LIMITS
    return [
        math.nan if (number := _num(value)) is None else min(high, max(low, number))
        for value in values
    ]


def _prediction_plot(runs: Sequence[Mapping[str, Any]]) -> str:
    recorded = _predictive(runs, "prediction")
    if not recorded:
        return _missing("per-request prediction errors")
    rows, _ = _grid(len(recorded))
    figure = _figure(11, 2.9 * rows + 0.4)
    for axes, run in zip(_panels(figure, len(recorded)), recorded, strict=True):
        prediction = _map(_series(run)["prediction"])
        arrival = [_num(value) for value in _list(prediction.get("arrival_s"))]
        for key, colour, label in (
            ("placement_error", "#ff7f0e", "at placement"),
            ("arrival_error", "#1f77b4", "projection at arrival (scored)"),
        ):
            errors = _clipped(_list(prediction.get(key)))
            points = [
                (x, y) for x, y in zip(arrival, errors, strict=False) if x is not None and y == y
            ]
            if points:
                axes.scatter(
                    [x for x, _ in points],
                    [y for _, y in points],
                    s=3,
                    alpha=0.4,
                    color=colour,
                    label=label,
                    linewidths=0,
                )
        for level in (0.1, 0.3):
            for sign in (1, -1):
                axes.axhline(sign * level, color="grey", linestyle=":", linewidth=0.8)
        axes.axhline(0, color="black", linewidth=0.8)
        error = _map(run.get("projection_error"))
        axes.set_title(
            f"{float(run['load']):g}x: arrival error median {_pct(error.get('median_abs'))}, "
            f"p90 {_pct(error.get('p90_abs'))}",
            fontsize="small",
        )
        axes.set_ylim(*_ERROR_LIMITS)
        axes.set_xlabel("arrival (virtual s)")
        axes.set_ylabel("(predicted - observed) / observed")
        axes.grid(True, alpha=0.3)
        _legend(axes, fontsize="x-small", markerscale=3)
    return _image(figure, "prediction error over time") + (
        "<p>Each admitted request's signed relative TTFT error against its arrival time; the "
        f"axis is cut at {_ERROR_LIMITS[0]:g} and {_ERROR_LIMITS[1]:g} (errors beyond are drawn "
        "on its edge). Dotted: +/-10 % and +/-30 %, the targets of the median and the p90 of "
        "the absolute error at arrival.</p>"
    )


def _router_plot(runs: Sequence[Mapping[str, Any]]) -> str:
    recorded = _predictive(runs, "router")
    if not recorded:
        return _missing("the safety factor and engine drift over time")
    figure = _figure(11, 5.6)
    axes = figure.subplots(2, len(recorded), squeeze=False)
    for column, run in enumerate(recorded):
        samples = _map(_series(run)["router"])
        times = _numbers(samples.get("t_s"))
        top, bottom = axes[0][column], axes[1][column]
        factor = _list(samples.get("safety_factor"))
        points = [
            (t, value)
            for t, raw in zip(times, factor, strict=False)
            if (value := _num(raw)) is not None
        ]
        top.plot([t for t, _ in points], [v for _, v in points], color="#1f77b4")
        top.set_title(f"{float(run['load']):g}x", fontsize="small")
        top.set_ylabel("safety factor" if column == 0 else "")
        top.grid(True, alpha=0.3)
        engines = _map(samples.get("engines"))
        for number, (name, raw) in enumerate(sorted(engines.items())):
            engine = _map(raw)
            colour = f"C{number % 10}"
            for key, style in (("ttft", "-"), ("tpot", "--")):
                values = _list(engine.get(key))
                line = [
                    (t, v)
                    for t, item in zip(times, values, strict=False)
                    if (v := _num(item)) is not None and v > 0
                ]
                if line:
                    bottom.plot(
                        [t for t, _ in line],
                        [v for _, v in line],
                        linestyle=style,
                        color=colour,
                        label=f"{name} {key}",
                    )
            named: set[str] = set()  # each state is named once per engine: changes can be many
            for change in _list(engine.get("states")):
                at, state = [*_list(change), None, None][:2]
                when = _num(at)
                if when is not None and isinstance(state, str) and state != "ok":
                    bottom.axvline(when, color=colour, alpha=0.5, linewidth=0.8)
                    if state in named:
                        continue
                    named.add(state)
                    bottom.annotate(
                        state,
                        (when, 1.0),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        va="top",
                        fontsize="x-small",
                        color=colour,
                    )
        for level in (1.5, 3.0):
            bottom.axhline(level, color="grey", linestyle=":", linewidth=0.8)
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.set_ylim(bottom=0)
        bottom.set_xlabel("virtual s")
        bottom.set_ylabel("drift: observed / predicted" if column == 0 else "")
        bottom.grid(True, alpha=0.3)
        _legend(bottom, fontsize="x-small")
    return _image(figure, "safety factor and engine drift over time") + (
        "<p>Sampled once per virtual second. Top: the safety factor on predicted waits "
        "(<code>narwhal_admission_safety_factor</code>). Bottom: each engine's running ratio "
        "of observed to predicted TTFT (solid) and TPOT (dashed); dotted at 1.5 (sustained "
        "drift) and 3 (severe); a vertical line marks a change to a drift state other than "
        "ok, named at its first.</p>"
    )
