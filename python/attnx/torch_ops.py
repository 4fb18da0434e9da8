"""``attnx.torch_ops`` is :mod:`attnx.integrations.torch_ops` (the name existing code imports)."""

import sys

from .integrations import torch_ops as _module

sys.modules[__name__] = _module
