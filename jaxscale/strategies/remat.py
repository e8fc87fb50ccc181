r"""Activation checkpointing (rematerialisation) as policies over the model's named activations.

The model tags activations with `checkpoint_name` (`jaxscale.models.llama.TAGS`); each layer's pure
function is wrapped in `jax.checkpoint` with a policy saying, per name, save (keep for the
backward), remat (recompute in the backward) or offload (keep in `pinned_host` memory):

| policy               | saved                                        | recomputed per layer      |
|----------------------|----------------------------------------------|---------------------------|
| `none`               | everything the backward needs                | nothing                   |
| `full`               | the layer input only                         | the whole layer forward   |
| `save_dots`          | matmul outputs without batch dims (projections) | norms, activations, attention scores |
| `save_attention_out` | the attention output                         | everything else           |
| `offload`            | projections and attention output, on the host | the rest                  |
| custom `name:save\|remat\|offload,...` | as given; unnamed tags are rematerialised | |

Cost: full remat replays each layer's forward but its last matmul (whose output no backward
needs), so block FLOPs grow a little under 4/3 (tests/test_memory.py has the exact ratio); memory falls to
one [b, s, h] input per layer plus one layer's activations live at a time. Collectives: under TP
or FSDP the recomputed forward repeats its all-reduces / all-gathers. Offload adds device<->host
copies (PCIe bandwidth) instead of recompute.
"""
from __future__ import annotations

from typing import Callable

import jax

from jaxscale.models.llama import TAGS

POLICIES = ("none", "full", "save_dots", "save_attention_out", "offload")
OFFLOADED = ("q_proj", "k_proj", "v_proj", "attn_out", "o_proj", "mlp_gate", "mlp_up", "mlp_down")
ACTIONS = ("save", "remat", "offload")


def parse(spec: str) -> dict[str, str] | str:
    """A policy name, or a custom {tag: action} mapping from 'tag:action,...'."""
    if spec in POLICIES:
        return spec
    if ":" not in spec:
        raise ValueError(f"unknown plan.remat {spec!r}; valid: {', '.join(POLICIES)}, or a custom "
                         f"mapping like 'attn_out:save,mlp_hidden:offload' over the model's tags: "
                         f"{', '.join(TAGS)}")
    mapping = {}
    for item in spec.split(","):
        name, _, action = item.strip().partition(":")
        if name not in TAGS:
            raise ValueError(f"plan.remat names unknown activation {name!r}; the model's tags are: "
                             f"{', '.join(TAGS)}")
        if action not in ACTIONS:
            raise ValueError(f"plan.remat: action {action!r} for {name!r} must be one of "
                             f"{', '.join(ACTIONS)}")
        mapping[name] = action
    return mapping


def checkpoint_policy(spec: str):
    """The `jax.checkpoint` policy for `spec`, or None for no checkpointing."""
    p = parse(spec)
    cp = jax.checkpoint_policies
    if p == "none":
        return None
    if p == "full":
        return cp.nothing_saveable
    if p == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if p == "save_attention_out":
        return cp.save_only_these_names("attn_out")
    if p == "offload":
        p = {n: "offload" for n in OFFLOADED}
    save = [n for n, a in p.items() if a == "save"]
    off = [n for n, a in p.items() if a == "offload"]
    if not off:
        return cp.save_only_these_names(*save)
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=save, names_which_can_be_offloaded=off,
        offload_src="device", offload_dst="pinned_host")


def block_wrapper(spec: str) -> Callable | None:
    policy = checkpoint_policy(spec)
    if parse(spec) == "none":
        return None
    return lambda f: jax.checkpoint(f, policy=policy)
