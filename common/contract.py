"""What the two ends of the federation agree on beyond the messages of ``protos/wafl/v1/federation.proto``.

The server checks a client's ``JoinRequest.protocol_version`` against :data:`SUPPORTED_VERSIONS`; a joined
client sends the session credential its ``JoinReply`` handed out in the gRPC metadata entry
:data:`CREDENTIAL_KEY` of every later call; :data:`PROTOCOLS` names the client protocols a run may use.
Clients built from the .proto alone (``tests/independent_client.py``) restate these values from the .proto's
service comment, on purpose.
"""

from __future__ import annotations

from wafl.common.choices import Choice

PROTOCOL_VERSION = 2  # JoinRequest.protocol_version that these clients send
# 1: a client that ignores BroadcastHeader.upload_delta and always uploads its trained model; 2: one that
# uploads the difference to the model it received when the header says so. A version 1 client can join
# only a run whose uploads are whole models (the server refuses it where they are differences).
SUPPORTED_VERSIONS = (1, 2)
DELTA_UPLOADS_VERSION = 2  # the first version that reads BroadcastHeader.upload_delta
CREDENTIAL_KEY = "wafl-credential"  # gRPC metadata entry of the session credential Join hands out


class ClientProtocol(Choice):
    """A client protocol (the configuration's ``protocol``): when a client trains its personal model."""

    WAIT_FREE = "wait-free"  # in the background, from its upload until the next broadcast arrives
    COMPUTE_AND_WAIT = "compute-and-wait"  # for ``pm_epochs`` before its upload
    ADAPTIVE = "adaptive"  # the part of ``pm_epochs`` its wait would not hold before its upload, then wait-free


PROTOCOLS = tuple(p.value for p in ClientProtocol)  # the client protocols' names; the first is the default
