"""The public interface of :mod:`wafl.client` for hosting clients inside another program: what the in-process
simulation (:mod:`wafl.cli.sim`) builds its clients from, instead of reaching into the modules below.

A host makes one :class:`Trainer` per client, wraps each in :func:`client_protocol` over a session of its own
(a :class:`wafl.cli.sim.local_transport.LocalSession` speaks to the engine in process, as
:class:`wafl.client.session.Session` does over gRPC) and runs them in one event loop. The session side uses
the same wire helpers as the gRPC session: :class:`ModelAssembler` turns a broadcast's messages into a
:class:`ReceivedModel`, :func:`upload_header` and :func:`upload_messages` write an upload's messages,
:func:`report_request` a round report. Clients that train in turns share :class:`SharedSlots` (the slots of a
``wafl worker``) or :class:`ProcessSlots` (trainings in forked processes); clients that receive the same
broadcast share one :class:`SharedReception`. :func:`warm_up_torch` is the client processes' start-up warm-up.

Only names listed in ``__all__`` are the interface; :mod:`wafl.cli.sim` imports nothing else from
:mod:`wafl.client` (tests/test_client_hosting.py checks it).
"""

from __future__ import annotations

from wafl.client.compute import SharedSlots
from wafl.client.process_slots import ProcessSlots
from wafl.client.protocol import client_protocol
from wafl.client.reception import SharedReception
from wafl.client.session import ModelAssembler, ReceivedModel, report_request, upload_header, upload_messages
from wafl.client.startup import warm_up_torch
from wafl.client.trainer import Trainer

__all__ = [
    "ModelAssembler",
    "ProcessSlots",
    "ReceivedModel",
    "SharedReception",
    "SharedSlots",
    "Trainer",
    "client_protocol",
    "report_request",
    "upload_header",
    "upload_messages",
    "warm_up_torch",
]
