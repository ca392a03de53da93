"""What the two ends of the federation agree on beyond the messages of ``protos/wafl/v1/federation.proto``.

The server checks a client's ``JoinRequest.protocol_version`` against :data:`PROTOCOL_VERSION`; a joined
client sends the session credential its ``JoinReply`` handed out in the gRPC metadata entry
:data:`CREDENTIAL_KEY` of every later call; :data:`PROTOCOLS` names the client protocols a run may use.
Clients built from the .proto alone (``tests/independent_client.py``) restate these values from the .proto's
service comment, on purpose.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1  # JoinRequest.protocol_version that this server speaks and these clients send
CREDENTIAL_KEY = "wafl-credential"  # gRPC metadata entry of the session credential Join hands out
PROTOCOLS = ("wait-free", "compute-and-wait")  # the client protocols; the first is the default
