"""attnx in other frameworks: torch :mod:`~attnx.integrations.tensors` at every entry point,
:mod:`~attnx.integrations.torch_ops` (``torch.library`` ops), :mod:`~attnx.integrations.sdpa`
(``scaled_dot_product_attention``), :mod:`~attnx.integrations.hf` (Hugging Face),
:mod:`~attnx.integrations.layers` (a multi-head attention layer) and
:mod:`~attnx.integrations.vllm` (vLLM's CPU backend). Nothing here is imported by ``import attnx``
that would import torch, transformers or vllm."""
