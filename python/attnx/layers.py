"""``attnx.layers`` is :mod:`attnx.integrations.layers` (the name existing code imports)."""

import sys

from .integrations import layers as _module

sys.modules[__name__] = _module
