"""``attnx.torch_compat`` is :mod:`attnx.integrations.sdpa` (the name existing code imports)."""

import sys

from .integrations import sdpa as _module

sys.modules[__name__] = _module
