"""Diagnostics: extra runs against a server changed in one respect, to attribute what the main phases
measure. Product files stay as they are: the changes are made at interpreter start by a ``sitecustomize``
module (:data:`SITECUSTOMIZE`) that only a diagnostic server's PYTHONPATH sees."""

from __future__ import annotations

import json
from typing import Any

# (module, class or "" for a module function, function, key): what the server-stage-times diagnostic times;
# checked to exist before any server starts (a sitecustomize error would only be printed by the server)
STAGE_WRAPS = [
    ("wafl.server.aggregation.accumulator", "UploadFold", "add", "UploadFold.add (executor thread)"),
    ("wafl.common.codec", "TransferChecker", "check", "TransferChecker.check (event loop)"),
    ("wafl.server.service", "", "decode_upload", "decode_upload (event loop)"),
    ("wafl.server.aggregation.accumulator", "Accumulator", "mean", "Accumulator.mean (per round)"),
    ("wafl.server.mailbox", "Mailbox", "_encode", "Mailbox._encode (per round)"),
]

DIAGNOSTICS: dict[str, dict[str, Any]] = {
    "bdp-probe": {
        "kind": "concurrent",
        "what": (
            "server GRPC_OPTIONS with ('grpc.http2.bdp_probe', 1) instead of 0: gRPC grows each stream's "
            "HTTP/2 receive window from its bandwidth-delay estimate (its default)"
        ),
        "env": {"WAFL_BENCH_GRPC_OPTIONS": json.dumps([["grpc.http2.bdp_probe", 1]])},
    },
    "server-stage-times": {
        "kind": "single",
        "what": (
            "single-client uploads against a server whose UploadFold.add, TransferChecker.check, "
            "decode_upload, Accumulator.mean and Mailbox._encode are wrapped in "
            "time.perf_counter accumulators"
        ),
        "env": {"WAFL_BENCH_STAGE_TIMES": "{dir}/stage_times.json", "WAFL_BENCH_STAGE_WRAPS": json.dumps(STAGE_WRAPS)},
    },
    "malloc-fixed-mmap-threshold": {
        "kind": "concurrent",
        "what": (
            "server run with MALLOC_MMAP_THRESHOLD_=131072: glibc keeps a fixed mmap threshold, so freed "
            "buffers of 128 KiB and more go back to the OS at once (tells allocator retention from live memory)"
        ),
        "env": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    },
}
DEFAULT_DIAGNOSTICS = "bdp-probe,server-stage-times"
STAGE_TIMED_UPLOADS = 3
SITECUSTOMIZE = """import json, os
_opts = os.environ.get("WAFL_BENCH_GRPC_OPTIONS")
if _opts:
    import wafl.server.app as _app
    _new = [tuple(kv) for kv in json.loads(_opts)]
    _app.GRPC_OPTIONS[:] = [o for o in _app.GRPC_OPTIONS if o[0] not in {k for k, _ in _new}] + _new
_out = os.environ.get("WAFL_BENCH_STAGE_TIMES")
if _out:
    import importlib, signal, threading, time
    _stats, _lock, _seq = {}, threading.Lock(), [0]

    def _wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with _lock:
                    c = _stats.setdefault(key, [0, 0.0])
                    c[0] += 1
                    c[1] += dt

        setattr(owner, name, timed)

    for _mod, _cls, _name, _key in json.loads(os.environ["WAFL_BENCH_STAGE_WRAPS"]):
        _owner = importlib.import_module(_mod)
        _wrap(getattr(_owner, _cls) if _cls else _owner, _name, _key)

    def _dump(*_):
        with _lock:
            _seq[0] += 1
            data = {"seq": _seq[0], "stats": {k: list(v) for k, v in _stats.items()}}
        with open(_out + ".tmp", "w") as fh:
            json.dump(data, fh)
        os.replace(_out + ".tmp", _out)

    signal.signal(signal.SIGUSR1, _dump)
"""


def check_stage_wraps() -> None:
    """Raises SystemExit naming any function of :data:`STAGE_WRAPS` that the code no longer has."""
    import importlib

    missing = []
    for mod, cls, name, _ in STAGE_WRAPS:
        owner: Any = importlib.import_module(mod)
        if cls:
            owner = getattr(owner, cls, None)
        if owner is None or not callable(getattr(owner, name, None)):
            missing.append(f"{mod}.{cls + '.' if cls else ''}{name}")
    if missing:
        raise SystemExit(f"server-stage-times: the server no longer has {missing}; update STAGE_WRAPS")
