"""The targets and their checks, the machine's description, the JSON file and the printed summary."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from .common import MB
from .procfs import proc_meminfo_total

TARGETS = {
    "single_upload_vs_raw_tcp_min_ratio": 0.20,
    "concurrent_peak_rss_growth_max_model_multiples": 4.0,
    "noop_round_max_s": 2.0,
}


def target_checks(
    single: dict[str, Any], conc: dict[str, Any], noop: dict[str, Any], tcp_median: float
) -> dict[str, dict[str, Any]]:
    """Each target of :data:`TARGETS` against the phases' figures (``single``, ``conc``, ``noop``) and the raw
    TCP median: what was measured, the target, and whether it passes."""
    model_bytes = single["model"]["model_bytes"]
    rss = conc["rss_worst_round"]
    return {
        "single_upload_at_least_20pct_of_raw_tcp": {
            "measured_ratio": single["median_ratio_to_paired_raw_tcp"],
            "basis": "median over the uploads of (upload MB/s / MB/s of the raw TCP trial run right before it)",
            "ratio_median_upload_to_median_raw_tcp": single["ratio_to_raw_tcp_median"],
            "single_upload_MBps_median": single["median_MBps"],
            "raw_tcp_MBps_median": round(tcp_median, 1),
            "target": f">= {TARGETS['single_upload_vs_raw_tcp_min_ratio']}",
            "pass": single["median_ratio_to_paired_raw_tcp"] >= TARGETS["single_upload_vs_raw_tcp_min_ratio"],
        },
        "concurrent_peak_rss_within_idle_plus_4x_model": {
            "idle_VmRSS": rss["idle_VmRSS"],
            "peak_VmHWM": rss["peak_VmHWM"],
            "limit": rss["idle_VmRSS"] + int(TARGETS["concurrent_peak_rss_growth_max_model_multiples"] * model_bytes),
            "measured_model_multiples": rss["peak_minus_idle_model_multiples"],
            "target": f"<= {TARGETS['concurrent_peak_rss_growth_max_model_multiples']}",
            "pass": rss["peak_minus_idle_model_multiples"] <= TARGETS["concurrent_peak_rss_growth_max_model_multiples"],
        },
        "noop_round_under_2s": {
            "client_observed_s": noop["client_observed_s"],
            "server_round_s": noop["server_round_s"],
            "target": f"< {TARGETS['noop_round_max_s']} (both)",
            "pass": max(noop["client_observed_s"], noop["server_round_s"] or 0.0) < TARGETS["noop_round_max_s"],
        },
    }


def load_note(loadavg: dict[str, list[float]], nproc: int | None) -> str:
    """Whether other processes competed for the CPUs during the measurements (from the load averages read
    before each phase and at the end)."""
    one_min = [v[0] for k, v in loadavg.items() if k.startswith("before_") or k == "end"]
    return (
        f"1-minute load average {min(one_min):.1f}..{max(one_min):.1f} during the measurements on "
        f"{nproc} CPUs: other processes competed for the CPUs, so the figures, raw "
        "TCP included, vary from run to run"
        if max(one_min) > (nproc or 1)
        else "the load average stayed within the CPU count"
    )


def write_result(result: dict[str, Any], out: Path) -> None:
    """Writes the run's record as JSON (one space of indent, as the committed results are)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def machine_info() -> dict[str, Any]:
    import grpc
    import numpy
    import torch
    from google import protobuf

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = proc_meminfo_total()
    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "protobuf": protobuf.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def print_summary(r: dict[str, Any]) -> None:
    m, s, c, n, t = r["model"], r["single_client"], r["concurrent"], r["noop_round"], r["raw_tcp"]
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    ch = r["checks"]
    print()
    print(
        f"model: {m['params']:,} parameters ({m['float32_params']:,} float32), {m['model_bytes'] / MB:.1f} MB "
        f"in {m['tensors']} tensors"
    )
    print(
        f"machine: {r['machine']['nproc']} CPUs ({r['machine']['cpu']}), load average {r['loadavg']['start']} "
        f"-> {r['loadavg']['end']}"
    )
    print(f"note: {r['load_note']}")
    print(
        f"raw TCP loopback:            {t['median_MBps']:8.1f} MB/s  median, "
        f"{t['worst_MBps']:.0f}..{t['best_MBps']:.0f} over "
        f"{len(t['before'] + t['paired_with_single_uploads'] + t['after'])} trials"
    )
    print(f"1 client upload:             {s['median_MBps']:8.1f} MB/s  median of {[u['MBps'] for u in s['uploads']]}")
    print(
        f"  upload / raw TCP:          {s['median_ratio_to_paired_raw_tcp'] * 100:8.1f} %     median of "
        "per-upload ratios to the TCP trial just before "
        f"{[round(u['ratio_to_paired_raw_tcp'] * 100, 1) for u in s['uploads']]}  "
        f"[{ok(ch['single_upload_at_least_20pct_of_raw_tcp']['pass'])} >= 20%]"
    )
    print(
        f"                             {s['ratio_to_raw_tcp_median'] * 100:8.1f} %     median upload / median "
        f"TCP; best / best {s['ratio_best_to_best_raw_tcp'] * 100:.1f}%"
    )
    g = r["grpc_alone"]
    print(
        f"same {g['messages']} messages, bare grpc.aio: {g['plain']['median_MBps']:8.1f} MB/s  "
        f"({g['plain']['ratio_to_raw_tcp_median'] * 100:.1f}% of raw TCP); with an executor hop per message "
        f"{g['executor_hop_per_message']['median_MBps']:.1f} MB/s"
    )
    k = c["clients_uploading"]
    print(
        f"{k:2d} concurrent, per client:   {c['per_client_median_MBps']:8.1f} MB/s  median, "
        f"{c['per_client_min_MBps']:.1f} min"
    )
    print(f"{k:2d} concurrent, aggregate:    {c['aggregate_MBps_median']:8.1f} MB/s  median of {c['aggregate_MBps']}")
    w = c["rss_worst_round"]
    print(
        f"server RSS, {k:2d} concurrent:   idle {w['idle_VmRSS'] / MB:.0f} MB, peak {w['peak_VmHWM'] / MB:.0f} "
        f"MB, +{w['peak_minus_idle'] / MB:.0f} MB = {w['peak_minus_idle_model_multiples']:.2f} x model (worst; "
        f"first rounds {c['rss_first_round_model_multiples']})  "
        f"[{ok(ch['concurrent_peak_rss_within_idle_plus_4x_model']['pass'])} <= 4]"
    )
    print(
        f"no-op round (5 clients):     client-observed {n['client_observed_s']:.3f} s, server round_s "
        f"{n['server_round_s']:.3f} s  [{ok(ch['noop_round_under_2s']['pass'])} < 2 s]"
    )
    sc = r["stage_costs"]
    print(
        f"chunk-path CPU (in-process): server {sc['server_seconds_per_upload']:.3f} s/upload (ceiling "
        f"{sc['server_ceiling_MBps']:.0f} MB/s), client {sc['client_seconds_per_upload']:.3f} s/upload "
        f"(ceiling {sc['client_ceiling_MBps']:.0f} MB/s)"
    )
    for d, res in r.get("diagnostics", {}).items():
        if "uploads" in res:
            u = res["uploads"][len(res["uploads"]) // 2]
            print(
                f"  diagnostic {d} (round {u['round']}): upload {u['seconds']} s = "
                + " + ".join(f"{k.split(' ')[0]} {v['seconds']}" for k, v in u["stages"].items())
                + f" + other {u['unaccounted_s']}"
            )
            continue
        print(
            f"  diagnostic {d}: +{res['rss']['peak_minus_idle'] / MB:.0f} MB = "
            f"{res['rss']['peak_minus_idle_model_multiples']:.2f} x model, aggregate "
            f"{res['aggregate_MBps']:.1f} MB/s (first round; compare the round-1 figures above)"
        )
    print(f"overall: {ok(r['all_pass'])}")
