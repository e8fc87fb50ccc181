"""Matched JAX vs PyTorch baselines: the same LLaMA in PyTorch (`torch_llama`) and training runs of
jaxscale DP / FSDP / TP against DDP / FSDP2 / DTensor tensor parallelism (`matched_training`).

PyTorch is needed here only: nothing under `jaxscale/` imports it.
"""
