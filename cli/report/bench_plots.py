"""The benchmarks' pictures: every client's phases as a Gantt chart per run, and accuracy against wall-clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wafl.cli.report.run_records import Timelines, timeline_events
from wafl.common.contract import ClientProtocol

# the baseline, compute-and-wait, first; adaptive, which learns from the two, last
PROTOCOL_ORDER = tuple(
    p.value for p in (ClientProtocol.COMPUTE_AND_WAIT, ClientProtocol.WAIT_FREE, ClientProtocol.ADAPTIVE)
)


PHASE_COLORS = {
    "gm_train": "tab:blue",
    "pm_train": "tab:orange",
    "upload": "tab:green",
    "evaluate": "tab:purple",
    "idle": "tab:red",
}


def _aligned(timelines: Timelines) -> tuple[list[str], dict[str, list[tuple[str, int, float, float]]]]:
    """Every client's events on one clock: seconds since the earliest first phase of any client."""
    clients = sorted(timelines, key=lambda c: (len(c), c))
    starts = {c: float(timelines[c].get("client_start_unix") or 0.0) for c in clients}
    firsts = [
        starts[c] + float(timeline_events(timelines[c])[0]["start_s"]) for c in clients if timeline_events(timelines[c])
    ]
    base = min(firsts) if firsts else 0.0
    out = {
        c: [
            (e["phase"], int(e["round"]), starts[c] + float(e["start_s"]) - base, starts[c] + float(e["end_s"]) - base)
            for e in timeline_events(timelines[c])
        ]
        for c in clients
    }
    return clients, out


def plot_timelines(runs: Mapping[str, Timelines], path: Path, title: str = "") -> None:
    """A Gantt chart per protocol: per client, compute phases on the upper lane, uploads below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [p for p in PROTOCOL_ORDER if p in runs] + [p for p in runs if p not in PROTOCOL_ORDER]
    n_clients = max((len(runs[p]) for p in names), default=1)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(12, 1.0 + 0.55 * n_clients * len(names) + 0.6 * len(names)), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], names):
        clients, events = _aligned(runs[name])
        for row, c in enumerate(clients):
            y = len(clients) - 1 - row
            for phase, _rnd, s, e in events[c]:
                if phase == "decide":  # an adaptive client's decision: a tick, not a phase with a length
                    ax.plot([s, s], [y - 0.45, y + 0.45], color="black", lw=0.6)
                elif phase == "upload":
                    ax.broken_barh([(s, max(e - s, 1e-3))], (y - 0.42, 0.3), facecolors=PHASE_COLORS[phase])
                else:
                    ax.broken_barh(
                        [(s, max(e - s, 1e-3))],
                        (y - 0.08, 0.5),
                        facecolors=PHASE_COLORS.get(phase, "grey"),
                        edgecolor="white",
                        linewidth=0.3,
                    )
        ax.set_yticks(range(len(clients)))
        ax.set_yticklabels(list(reversed(clients)))
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("wall-clock (s since the first client phase)")
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pm_accuracy(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    target: float | None = None,
    zetas: Mapping[str, float | None] | None = None,
    title: str = "",
) -> None:
    """PM accuracy (test-size-weighted mean of the latest reports) against wall-clock, per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        if curve:
            ts, accs = zip(*curve)
            line = ax.step(ts, accs, where="post", marker="o", ms=3, label=name)[0]
            z = (zetas or {}).get(name)
            if z is not None:
                ax.axvline(z, color=line.get_color(), ls=":", lw=1)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("wall-clock since round 1 opened (s)")
    ax.set_ylabel("PM accuracy (local test sets)")
    save_plot(fig, ax, path, title)


def save_plot(fig: Any, ax: Any, path: Path, title: str = "") -> None:
    """Title, grid and legend on ``ax``, then ``fig`` written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
