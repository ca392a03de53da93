"""New clients (``new_clients = K``): K client indices held out of training, drawn from the seed.

They hold a shard of the partition like every client, join like every client, and are never
selected and never upload. After each round whose global model is evaluated (``eval_every``, and
the last) each of them adapts that model as its algorithm prescribes (:meth:`Trainer.adapt
<wafl.client.trainer.Trainer.adapt>`: a personal phase trains the PM from it; otherwise it is
fine-tuned) for ``new_client_epochs`` epochs on its local training split and tests it on its local
test split. A pure function of the configuration, so the server, every client process and an
in-process run agree on who is new without a message.
"""

from __future__ import annotations

import numpy as np

STREAM = 9  # the seed stream of the draw (selection uses 5, a client's own generator 6)


def new_client_indices(num_clients: int, new_clients: int, seed: int) -> frozenset[int]:
    """The ``new_clients`` indices of ``0..num_clients - 1`` held out of training (none for 0)."""
    if new_clients <= 0:
        return frozenset()
    rng = np.random.default_rng([seed, STREAM])
    return frozenset(int(i) for i in rng.choice(num_clients, size=new_clients, replace=False))
