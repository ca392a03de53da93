"""The cost of each step of the chunk path, measured in-process on the benchmark's own model."""

from __future__ import annotations

import time
from typing import Any

from .client import NUM_SAMPLES
from .common import MB


def stage_costs(repeat: int = 3) -> dict[str, Any]:
    """Per-MB cost of each step of the chunk path, on the benchmark's own model, in this process."""
    import numpy as np
    import torch
    from wafl.client.session import ModelAssembler
    from wafl.common.checksum import IMPLEMENTATION, crc32
    from wafl.common.codec import TransferChecker, iter_chunks, manifest_of, numpy_view
    from wafl.common.models import build_model
    from wafl.common.proto import federation_pb2 as pb
    from wafl.common.wire import (
        PreEncoded,
        chunks_of,
        decode_broadcast,
        decode_upload,
        encode_tensors,
        encode_upload,
        group_chunks,
        write_transfer,
    )
    from wafl.server.aggregation.accumulator import Accumulator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in build_model("resnet18", 10, 3, 32, 32).state_dict().items()}
    manifest = manifest_of(state)
    nbytes = sum(s.nbytes for s in manifest)
    chunks = list(iter_chunks(state.items()))
    messages = list(group_chunks(chunks))
    encoded = [encode_upload(m) for m in messages]
    spec_by_name = {s.name: s for s in manifest}

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def memcpy() -> None:
        dst = bytearray((1 << 20) + (64 << 10))
        for e in encoded:
            memoryview(dst)[: len(e)] = e

    def crc() -> None:
        c = 0
        for ch in chunks:
            c = crc32(ch.data, c)

    decoded = [c for e in encoded for c in chunks_of(decode_upload(e))]

    def check() -> None:
        ck = TransferChecker(manifest, require_finite=False, compute_crc=False)
        for d in decoded:
            ck.check(d)

    def fold_fresh() -> None:  # a server's first round also faults in the float64 sums
        acc = Accumulator(manifest)
        fold = acc.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()

    warm = Accumulator(manifest)
    warm.reset()  # as the server does before every round: the pages below are resident

    def fold_warm() -> None:
        fold = warm.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()

    fold_warm()  # the spill file in the pool now holds its pages, as after a server's first upload
    views = [(spec_by_name[d.name], d, numpy_view(d.data, spec_by_name[d.name].dtype)) for d in decoded]
    scratch = np.empty(max(v.size for _, _, v in views), dtype=np.float64)
    contribs = [np.multiply(v, 100.0, dtype=np.float64) for _, _, v in views]

    def f_multiply() -> None:
        for _, _, v in views:
            np.multiply(v, 100.0, out=scratch[: v.size], dtype=np.float64)

    def f_sum() -> None:
        for c in contribs:
            float(np.add.reduce(c))

    spill = warm.spills.acquire()

    def f_spill() -> None:
        spill.seek(0)
        for _, d, _ in views:
            spill.write(d.data)

    def f_add() -> None:
        for (spec, d, v), c in zip(views, contribs):
            start = d.offset // v.itemsize
            target = warm.sums[spec.name][start : start + v.size]
            np.add(target, c, out=target)

    warm.total_weight, warm.count = float(NUM_SAMPLES), 1

    def encode_broadcast() -> None:  # Mailbox._encode: write_transfer, chunk messages encoded once
        [
            m if isinstance(m, pb.BroadcastMessage) else PreEncoded(encode_tensors(m))
            for m in write_transfer(pb.BroadcastMessage, state.items())
        ]

    bc_encoded = [
        m.SerializeToString() if isinstance(m, pb.BroadcastMessage) else encode_tensors(m)
        for m in write_transfer(pb.BroadcastMessage, state.items())
    ]
    header = pb.BroadcastMessage(header=pb.BroadcastHeader(round=1, num_tensors=len(manifest), total_bytes=nbytes))

    def assemble() -> None:  # what Session.models() does with one broadcast
        asm = ModelAssembler(manifest)
        asm.feed(header)
        for e in bc_encoded:
            asm.feed(decode_broadcast(e))

    per_upload = {
        "client: group_chunks + encode_upload (protobuf prefixes + data, one join copy per message)": lambda: [
            encode_upload(m) for m in group_chunks(chunks)
        ],
        f"client: CRC-32 ({IMPLEMENTATION}) of the chunk data (wire.write_transfer)": crc,
        "server: decode_upload (zero-copy views)": lambda: [decode_upload(e) for e in encoded],
        "server: TransferChecker.check": check,
        f"server: CRC-32 ({IMPLEMENTATION}) in the fold thread (FoldPipeline)": crc,
        "server: UploadFold.add, later rounds (sums and spill file resident)": fold_warm,
        "server: UploadFold.add, a server's first round (faults in the float64 sums)": fold_fresh,
        "server: UploadFold.add part: np.multiply(values, w) into the float64 scratch": f_multiply,
        "server: UploadFold.add part: np.add.reduce(contribution) finite check": f_sum,
        "server: UploadFold.add part: spill.write(chunk) to a pooled temp file": f_spill,
        "server: UploadFold.add part: np.add(sums, contribution) in place": f_add,
        "reference: one memcpy of every encoded message": memcpy,
    }
    per_round = {
        "server: Accumulator.mean": warm.mean,
        "server: encode the broadcast (write_transfer + encode_tensors, Mailbox._encode)": encode_broadcast,
        "client: receive one broadcast (decode + ModelAssembler.feed: check, CRC, copy, tensors)": assemble,
    }
    out: dict[str, Any] = {
        "model_bytes": nbytes,
        "chunks": len(chunks),
        "messages": len(messages),
        "repeat": repeat,
        "note": (
            "best of `repeat`, one thread, in the benchmark's parent process after the other phases; MBps "
            "= model bytes / seconds"
        ),
        "per_upload": {},
        "per_round": {},
    }
    for group, steps in (("per_upload", per_upload), ("per_round", per_round)):
        for name, fn in steps.items():
            sec = best(fn)
            out[group][name] = {"seconds_per_model": round(sec, 4), "MBps": round(nbytes / sec / MB, 1)}
    up = out["per_upload"]
    srv = sum(
        v["seconds_per_model"]
        for k, v in up.items()
        if k.startswith("server: ") and "part:" not in k and "first round" not in k
    )
    cli = sum(v["seconds_per_model"] for k, v in up.items() if k.startswith("client: "))
    out["server_seconds_per_upload"] = round(srv, 4)
    out["server_ceiling_MBps"] = round(nbytes / srv / MB, 1)
    out["client_seconds_per_upload"] = round(cli, 4)
    out["client_ceiling_MBps"] = round(nbytes / cli / MB, 1)
    out["ceiling_note"] = (
        "the Python-side work one upload costs (decode + check + CRC + warm fold on the server; grouping, "
        "encoding + CRC on the client), gRPC's own work excluded"
    )
    return out
