"""``attnx.vllm`` is :mod:`attnx.integrations.vllm` (the name existing code imports)."""

import sys

from .integrations import vllm as _module

sys.modules[__name__] = _module
