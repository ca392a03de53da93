"""How the uploads of a collection combine into the next model, streamed: server memory O(model).

* ``accumulator.py``: the running weighted sums (:class:`~wafl.server.aggregation.accumulator.Accumulator`)
  and each upload's fold into them, chunk by chunk, with its commit and rollback (``UploadFold``);
* ``spill.py``: where a fold keeps its received chunks until it ends: the memory budget
  (``RetainedBytes``) and the spill file (``SpillArena``);
* ``robust.py``: the coordinate-wise robust centers (median, trimmed mean), one registered function each;
* ``norm_bound.py``: the bound on each update's L2 norm (``NormBound``, ``sq_norm``);
* ``rule.py``: how uploads combine (``Rule``), checked from the configuration's ``aggregator``.
"""
