"""``attnx.hf`` is :mod:`attnx.integrations.hf` (the name existing code imports)."""

import sys

from .integrations import hf as _module

sys.modules[__name__] = _module
