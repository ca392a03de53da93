#!/usr/bin/env python
"""GPU check: one short wait-free round of SCD with ResNet-18 on synthetic CIFAR-shaped data.

Run through ``bash benchmarks/gpu_check.sh`` on a machine with a GPU (it finds the virtual
environment and stops this script after 280 s), or directly::

    python benchmarks/gpu_check.py                      # --device cuda
    python benchmarks/gpu_check.py --device cpu --gm-steps 2 --pm-steps 2 --batch-size 8   # smoke check

What one round does, in this process, with the client's real :class:`wafl.client.trainer.Trainer`:

1. the GM trains ``--gm-steps`` batches on the default stream; each step is timed on the host
   after ``torch.cuda.synchronize()``;
2. the PM phase starts in a worker thread through ``Trainer.train_pm`` (on a GPU: on the
   trainer's own CUDA stream) with a stop condition, while the main thread does what the
   upload does: copies the GM state to the CPU (``Trainer.gm_upload_state``) and cuts it into
   wire chunks (``wafl.common.codec.iter_chunks``), each serialized to protobuf bytes;
3. the main thread simulates the next broadcast's arrival once the PM has completed
   ``--pm-steps`` steps by setting the stop condition; the PM stops before its next batch.

4. the client's tensors go to host memory and back (``Trainer.offload``/``onload``, what a worker
   does for an idle hosted client), and the PM trains two more steps.

Printed: the device, GM and PM step times (ms; on CUDA the PM steps also from CUDA events on
the PM stream), the PM steps completed, the stream the PM ran on, the upload's interval and
whether PM work ran during it (the intervals overlap), the offload's and onload's times and the
device memory in use before and after the offload. Exit 0 when every check passed, 1 when one
failed (PM on the default stream on CUDA, no overlap, the stop not honoured, no device memory
freed by the offload, the PM not training after the onload), 2 when the
requested device is not available. ``--json FILE`` also writes everything measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from collections import OrderedDict
from itertools import islice
from pathlib import Path
from typing import Any

from _machine import cpu_name, provenance


def _fail(msg: str, code: int) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--gm-steps", type=int, default=10, help="GM batches (the first includes warm-up)")
    p.add_argument("--pm-steps", type=int, default=30, help="PM steps after which the broadcast 'arrives'")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="synthetic-cifar10")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--wait-limit-s", type=float, default=150.0, help="longest wait for --pm-steps PM steps")
    p.add_argument("--json", help="also write the measurements to this file")
    p.add_argument(
        "--smoke", action="store_true", help="on the CPU, the cnn, 2 GM and 2 PM steps of 8: checks the script"
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.gm_steps, a.pm_steps, a.batch_size, a.model = "cpu", 2, 2, 8, "cnn"
    if a.gm_steps < 1 or a.pm_steps < 1 or a.batch_size < 2:
        p.error("--gm-steps and --pm-steps must be >= 1, --batch-size >= 2")
    return a


def _ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "median": None, "mean": None, "min": None, "max": None}
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs)}


def _fmt(d: dict[str, Any]) -> str:
    if not d["n"]:
        return "none"
    return f"median {d['median']:.1f} ms, mean {d['mean']:.1f}, min {d['min']:.1f}, max {d['max']:.1f} (n={d['n']})"


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA support"
        _fail(
            f"--device {a.device} but CUDA is not available here (torch {torch.__version__}, built with {built}; "
            f"{torch.cuda.device_count()} device(s) visible). Run this on a machine with an NVIDIA GPU and driver, "
            "or pass --device cpu for a CPU smoke check.",
            2,
        )
    try:
        from wafl.client.trainer import Trainer
        from wafl.common.codec import iter_chunks
        from wafl.common.config import ConfigError, load_config
        from wafl.common.training import epochs, make_optimizer, run_phase
    except ImportError as e:
        _fail(f"cannot import wafl ({e}); run through benchmarks/gpu_check.sh or install the repo (scripts/venv.sh)", 2)

    try:
        cfg = load_config(
            None,
            {
                "dataset": a.dataset,
                "model": a.model,
                "algorithm": "scd",
                "protocol": "wait-free",
                "partition": "iid",
                "num_clients": 1,
                "rounds": 1,
                "local_epochs": 1,
                "batch_size": a.batch_size,
                "device": a.device,
            },
        )
    except ConfigError as e:
        _fail(f"configuration error: {e}", 2)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, 0, device=a.device)
    dev = trainer.device
    cuda = dev.type == "cuda"
    device_name = torch.cuda.get_device_name(dev) if cuda else f"{cpu_name()}, {torch.get_num_threads()} threads"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    setup_s = time.perf_counter() - t0
    global_state = OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in trainer.gm.state_dict().items())
    ctx = trainer.begin_round(1, global_state)
    num_params = sum(p.numel() for p in trainer.gm.parameters())

    # ---------------------------------------------------------------- GM phase, default stream
    gm_marks: list[float] = []
    sync()
    gm_start = time.perf_counter()

    def on_gm_step(_: int) -> None:
        sync()
        gm_marks.append(time.perf_counter())

    data = epochs(trainer.data.train, trainer.train_idx, cfg.training.batch_size, trainer.rng, None, dev)
    gm_stats = run_phase(
        trainer.gm,
        trainer.algorithm.gm_terms,
        ctx,
        islice(data, a.gm_steps),
        make_optimizer(
            cfg.training.optimizer,
            trainer.gm.parameters(),
            cfg.training.lr,
            cfg.training.momentum,
            cfg.training.weight_decay,
        ),
        on_step=on_gm_step,
    )
    gm_steps_ms = [(b - a_) * 1e3 for a_, b in zip([gm_start, *gm_marks[:-1]], gm_marks)]

    # ---------------------------------------------------------------- PM phase in a thread, upload here
    stop = threading.Event()
    pm_marks: list[float] = []  # host time at each check between PM batches (each step ends with a loss sync)
    pm_events: list[Any] = []  # CUDA events recorded on the PM's stream at the same checks
    pm_stream_info: dict[str, Any] = {}
    pm_result: dict[str, Any] = {}

    def should_stop() -> bool:
        pm_marks.append(time.perf_counter())
        if cuda:
            s = torch.cuda.current_stream(dev)
            if not pm_stream_info:
                pm_stream_info.update(
                    stream=repr(s), default=s == torch.cuda.default_stream(dev), own=s == trainer.pm_stream
                )
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
            pm_events.append(ev)
        return stop.is_set()

    def pm_worker() -> None:
        try:
            pm_result["start"] = time.perf_counter()
            stats = trainer.train_pm(should_stop, None, 0)
            pm_result["end"] = time.perf_counter()
            pm_result["stats"] = stats
        except BaseException as e:  # reported by the main thread
            pm_result["error"] = e
            pm_result["end"] = time.perf_counter()

    sync()
    ref_host = time.perf_counter()
    worker = threading.Thread(target=pm_worker, name="pm", daemon=True)
    worker.start()

    up_start = time.perf_counter()
    state = trainer.gm_upload_state()  # device -> host copy, as the upload does
    nbytes = 0
    nchunks = 0
    for chunk in iter_chunks(state.items()):
        nbytes += len(chunk.to_proto().SerializeToString())
        nchunks += 1
    up_end = time.perf_counter()

    deadline = time.perf_counter() + a.wait_limit_s
    # pm_marks holds one check per batch: steps done = checks - 1 (the first check precedes step 1)
    while len(pm_marks) - 1 < a.pm_steps and worker.is_alive() and time.perf_counter() < deadline:
        time.sleep(0.001)
    broadcast_at = time.perf_counter()
    steps_at_broadcast = max(0, len(pm_marks) - 1)
    stop.set()
    worker.join(timeout=max(30.0, a.wait_limit_s))
    if worker.is_alive():
        _fail("the PM phase did not stop after the simulated broadcast", 1)
    if "error" in pm_result:
        raise pm_result["error"]
    stats = pm_result["stats"]

    # Step intervals: [phase start, first check] is the PM set-up (teacher spectrum, first batch);
    # then one interval per step between consecutive checks.
    pm_setup = (pm_result["start"], pm_marks[0]) if pm_marks else (pm_result["start"], pm_result["end"])
    pm_step_iv = list(zip(pm_marks[:-1], pm_marks[1:]))
    pm_steps_ms = [(e - s) * 1e3 for s, e in pm_step_iv]
    pm_gpu_steps_ms: list[float] = []
    if cuda and len(pm_events) > 1:
        sync()
        pm_gpu_steps_ms = [e0.elapsed_time(e1) for e0, e1 in zip(pm_events[:-1], pm_events[1:])]
    upload = (up_start, up_end)
    steps_during_upload = sum(1 for iv in pm_step_iv if _overlap(iv, upload) > 0)
    work_overlap_s = _overlap(pm_setup, upload) + sum(_overlap(iv, upload) for iv in pm_step_iv)
    overlapped = work_overlap_s > 0
    stop_lag_steps = stats.steps - steps_at_broadcast

    # ---------------------------------------------------------------- a hosted client between its trainings
    # (wafl worker on a GPU, client/residency.py): its tensors to host memory and back, then two more PM steps
    sync()
    resident_bytes = torch.cuda.memory_allocated(dev) if cuda else 0
    t_off = time.perf_counter()
    trainer.offload("cpu")
    sync()
    off_ms = (time.perf_counter() - t_off) * 1e3
    offloaded_bytes = torch.cuda.memory_allocated(dev) if cuda else 0
    t_on = time.perf_counter()
    trainer.onload()
    sync()
    on_ms = (time.perf_counter() - t_on) * 1e3
    back = all(p.device == dev for p in [*trainer.gm.parameters(), *trainer.pm.parameters()])
    checks_after: list[int] = []
    after = trainer.train_pm(lambda: checks_after.append(0) or len(checks_after) > 2, None, 0)

    checks = {
        "pm_stopped_after_broadcast": bool(stats.stopped_early) and 0 <= stop_lag_steps <= 1,
        "pm_overlapped_upload": overlapped,
        "onload_trains_on": back and after.steps == 2 and math.isfinite(after.mean_loss),
    }
    if cuda:
        checks["pm_on_own_stream"] = bool(pm_stream_info.get("own")) and not pm_stream_info.get("default", True)
        checks["offload_frees_device_memory"] = offloaded_bytes < resident_bytes
    rel = lambda x: round(x - ref_host, 6)  # noqa: E731
    return {
        "device": str(dev),
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": a.model,
        "num_params": num_params,
        "dataset": a.dataset,
        "algorithm": "scd",
        "batch_size": cfg.training.batch_size,
        "setup_s": setup_s,
        "gm": {
            "steps": gm_stats.steps,
            "step_ms": gm_steps_ms,
            "first_ms": gm_steps_ms[0] if gm_steps_ms else None,
            "after_first": _ms(gm_steps_ms[1:]),
        },
        "pm": {
            "steps": stats.steps,
            "steps_at_broadcast": steps_at_broadcast,
            "stopped_early": stats.stopped_early,
            "setup_ms": (pm_setup[1] - pm_setup[0]) * 1e3,
            "step_ms": pm_steps_ms,
            "host": _ms(pm_steps_ms),
            "gpu_events": _ms(pm_gpu_steps_ms),
            "stream": pm_stream_info or None,
        },
        "upload": {
            "bytes": nbytes,
            "chunks": nchunks,
            "start_s": rel(up_start),
            "end_s": rel(up_end),
            "ms": (up_end - up_start) * 1e3,
        },
        "timeline_s": {
            "pm_start": rel(pm_result["start"]),
            "pm_first_step": rel(pm_marks[0]) if pm_marks else None,
            "broadcast": rel(broadcast_at),
            "pm_end": rel(pm_result["end"]),
        },
        "overlap": {
            "overlapped": overlapped,
            "pm_work_during_upload_ms": work_overlap_s * 1e3,
            "pm_steps_during_upload": steps_during_upload,
        },
        "residency": {
            "offload_ms": off_ms,
            "onload_ms": on_ms,
            "device_bytes_resident": resident_bytes,
            "device_bytes_offloaded": offloaded_bytes,
            "pm_steps_after_onload": after.steps,
        },
        "checks": checks,
        "wall_s": time.perf_counter() - t0,
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"device: {r['device']} ({r['device_name']}), torch {r['torch']}, CUDA {r['cuda']}",
        f"round: {r['algorithm']} wait-free, {r['model']} ({r['num_params'] / 1e6:.2f}M parameters), "
        f"{r['dataset']}, batch {r['batch_size']}; set-up {r['setup_s']:.1f} s",
        f"GM: {r['gm']['steps']} steps; first {r['gm']['first_ms']:.1f} ms (warm-up), then "
        f"{_fmt(r['gm']['after_first'])}",
        f"PM: {r['pm']['steps']} steps completed (broadcast after {r['pm']['steps_at_broadcast']}, stopped "
        f"early: {r['pm']['stopped_early']}); set-up {r['pm']['setup_ms']:.1f} ms; steps "
        f"{_fmt(r['pm']['host'])}",
    ]
    if r["pm"]["gpu_events"]["n"]:
        lines.append(f"PM steps from CUDA events on the PM stream: {_fmt(r['pm']['gpu_events'])}")
    if r["pm"]["stream"]:
        s = r["pm"]["stream"]
        lines.append(
            f"PM stream: {s['stream']} (default stream: {s['default']}, the trainer's own PM stream: {s['own']})"
        )
    u = r["upload"]
    lines.append(
        f"upload (GM state to CPU + {u['chunks']} wire chunks, {u['bytes'] / 1e6:.1f} MB): {u['ms']:.1f} ms, t "
        f"= {u['start_s']:.3f}..{u['end_s']:.3f} s"
    )
    tl = r["timeline_s"]
    lines.append(
        f"PM phase: t = {tl['pm_start']:.3f}..{tl['pm_end']:.3f} s (first step starts "
        f"{tl['pm_first_step']:.3f} s, broadcast {tl['broadcast']:.3f} s)"
    )
    o = r["overlap"]
    lines.append(
        f"overlap: PM ran concurrently with the upload: {'yes' if o['overlapped'] else 'NO'} "
        f"({o['pm_work_during_upload_ms']:.1f} ms of PM work incl. its set-up; {o['pm_steps_during_upload']} "
        "PM steps overlapped the upload)"
    )
    h = r["residency"]
    lines.append(
        f"hosted client off the device and back: offload {h['offload_ms']:.1f} ms, onload {h['onload_ms']:.1f} ms; "
        f"device memory {h['device_bytes_resident'] / 1e6:.1f} -> {h['device_bytes_offloaded'] / 1e6:.1f} MB; "
        f"{h['pm_steps_after_onload']} PM steps after the onload"
    )
    for name, ok in r["checks"].items():
        lines.append(f"check {name}: {'ok' if ok else 'FAILED'}")
    lines.append(f"total {r['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    r = run(a)
    print(report(r), flush=True)
    r.update(provenance())
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=2, default=str))
    return 0 if all(r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
