"""The operations: dense :mod:`~attnx.ops.attention`, :mod:`~attnx.ops.paged` attention over a
block pool, the shared-prefix :mod:`~attnx.ops.cascade`, :mod:`~attnx.ops.merge` of partial
results by log-sum-exp, and the gated :mod:`~attnx.ops.delta_rule`. Each normalises its arguments
and makes one call into the C++ core."""
