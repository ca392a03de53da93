"""Markdown table of every repetition under this folder (``<setting>/<algorithm>/rep<k>/protocols.json``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _cpu(entry: dict) -> str:
    hosts = ((entry.get("host_cpus") or {}).get("hosts")) or {}
    used = [h["cpu_fraction"] for h in hosts.values() if h.get("cpu_fraction") is not None]
    quota = [h["quota_cpus"] for h in hosts.values() if h.get("quota_cpus")]
    peak = [h["cpu_s"] / h["wall_s"] for h in hosts.values() if h.get("cpu_s") and h.get("wall_s")]
    if not quota:
        return "shared"
    return f"{statistics.mean(used):.2f} (max {max(peak):.2f}) / {statistics.mean(quota):.2f}"


def rows(root: Path = HERE) -> list[str]:
    out = [
        "| settings | algorithm | rep | rounds C&W / WF | idle C&W | idle WF | round speedup | ideal "
        "| round speedup / ideal | speedup / ideal | zeta C&W (s) | zeta WF (s) | WF faster | best PM C&W / WF "
        "| CPU used / quota C&W | CPU used / quota WF | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(root.glob("*/*/rep*/protocols.json")):
        d = json.loads(path.read_text())
        caw, wf = d["protocols"]["compute-and-wait"], d["protocols"]["wait-free"]
        zc, zw = caw.get("zeta_total_s"), wf.get("zeta_total_s")
        faster = "yes" if zw is not None and (zc is None or zw < zc) else "no"
        loads = [p["host_load_avg"]["before_1m"] for p in (caw, wf)]
        setting, alg, rep = path.parts[-4:-1]
        out.append(
            f"| {setting} | {alg} | {rep[3:]} | {caw['rounds']} / {wf['rounds']} "
            f"| {_f(caw['idle_fraction'])} | {_f(wf['idle_fraction'], '{:.5f}')} "
            f"| {_f(d['round_speedup'], '{:.2f}')} | {_f(d['ideal_speedup'], '{:.2f}')} "
            f"| **{_f(d.get('round_speedup_vs_ideal'), '{:.2f}')}** | {_f(d['speedup_vs_ideal'], '{:.2f}')} "
            f"| {_f(zc, '{:.1f}')} | {_f(zw, '{:.1f}')} | {faster} "
            f"| {_f(caw['best_pm_accuracy'])} / {_f(wf['best_pm_accuracy'])} | {_cpu(caw)} | {_cpu(wf)} "
            f"| {max(loads):.1f} |"
        )
    return out


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)))
