"""The tables of `sarathictl status --kubernetes`: one per pipeline, a row per stage."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sarathictl.kube.join import PipelineView

COLUMNS = (
    "stage", "pod", "node", "ready", "restarts",
    "util %", "bubble %", "idle %", "step ms", "in flight",
)  # fmt: skip
_LEFT = ("pod", "node")


def render_pipeline(view: PipelineView) -> RenderableType:
    ctl = view.controller
    model = view.status.model if view.status is not None else "?"
    serving = view.status is not None and view.status.serving and not view.problems
    title = (
        f"{view.objects.name}: {model}, {'serving' if serving else 'NOT SERVING'}; controller "
        f"{ctl.name} on {ctl.node or '-'} ({'ready' if ctl.ready else 'not ready'}, "
        f"{ctl.restarts} restarts)"
    )
    table = Table(title=title, title_justify="left")
    for column in COLUMNS:
        if column in _LEFT:  # names are copied into kubectl: folded, never cut short
            table.add_column(column, justify="left", overflow="fold")
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for row in view.stages:
        s = row.shares
        numbers = (
            (
                f"{s.utilization_pct:.1f}",
                f"{s.bubble_pct:.1f}",
                f"{s.idle_pct:.1f}",
                f"{s.step_time_p50_s * 1e3:.1f}",
                str(s.micro_batches_in_flight),
            )
            if s is not None
            else ("-",) * 5
        )
        pod = row.pod
        table.add_row(
            row.label, pod.name, pod.node or "-", "yes" if pod.ready else "no",
            str(pod.restarts), *numbers,
        )  # fmt: skip
    lines = [Text(problem, style="bold red") for problem in view.problems]
    return Group(table, *lines)


def render_release(views: list[PipelineView]) -> Group:
    return Group(*(render_pipeline(v) for v in views))
