"""Pure-NumPy reference for attnx: the executable definition of every entry point, one oracle per
operation (float64, plain loops and explicit masks; NumPy only, never ``attnx._core``).

- :mod:`attnx.reference.attention`: :func:`attention`, :func:`attention_weights` (the definition of
  attention itself, with its masks and modifiers, is that module's docstring);
- :mod:`attnx.reference.paged`: :func:`paged_attention`;
- :mod:`attnx.reference.sdpa`: :func:`scaled_dot_product_attention`;
- :mod:`attnx.reference.merge`: :func:`merge_attention`;
- :mod:`attnx.reference.delta_rule`: :func:`gated_delta_rule`;
- the quantised KV format, defined in :mod:`attnx.quant`: :func:`quantize_kv`,
  :func:`dequantize_kv`, :func:`quantised_dtype`, :func:`quantize_query`.
"""

from __future__ import annotations

from ..quant import QUANTISED_DTYPES, dequantize_kv, quantised_dtype, quantize_kv
from ..quant import quantised_max as quantised_max
from ..quant import quantize_query as quantize_query
from .attention import attention, attention_weights
from .delta_rule import gated_delta_rule
from .merge import merge_attention
from .paged import paged_attention
from .sdpa import scaled_dot_product_attention

__all__ = [
    "QUANTISED_DTYPES",
    "attention",
    "attention_weights",
    "dequantize_kv",
    "gated_delta_rule",
    "merge_attention",
    "paged_attention",
    "quantised_dtype",
    "quantize_kv",
    "scaled_dot_product_attention",
]
