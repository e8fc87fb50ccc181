"""Megatron tensor parallelism over the `tp` mesh axis.

Rules: `heads`, `kv_heads`, `mlp` and `vocab` over `tp`: Q/K/V and the MLP gate/up projections
are column-parallel, the attention output and MLP down projections row-parallel, the embedding
and LM head vocabulary-parallel (the cross-entropy reduces max/sum over `tp` without gathering
the logits). Collectives: per layer, two activation all-reduces of [b, s, h] in the forward
(after the row-parallel matmuls) and two in the backward (into the column-parallel inputs); one
more each for the vocabulary-parallel embedding (forward) and head (backward); small [b, s]
all-reduces for the softmax statistics. Memory: weights and the head/mlp activations split t ways;
the [b, s, h] residual stream stays replicated (sequence parallelism splits it).
"""
from __future__ import annotations

from jaxscale.strategies.common import Collective

AXIS = "tp"
DATA_AXIS = False
SHARDED = ("heads", "kv_heads", "mlp", "vocab")


def rules(rules) -> None:
    for name in SHARDED:
        rules.add(name, "tp", by="tp")


def validate(model, tp: int) -> list[str]:
    errs = []
    for field in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        v = getattr(model, field)
        if v % tp:
            errs.append(f"model.{field}={v} is not divisible by mesh.tp={tp}: choose tp dividing "
                        f"it or change the model (tensor parallelism splits {field} over tp)")
    return errs


def theory(cfg, mesh_cfg, local_batch: int, act_elem_bytes: int, recompute: bool) -> list[Collective]:
    """Per-device activation all-reduces; a fully rematerialised layer repeats its forward two."""
    if mesh_cfg.tp == 1:
        return []
    m = cfg.model
    act = local_batch * cfg.data.seq_len * m.dim * act_elem_bytes
    stats = local_batch * cfg.data.seq_len * 4
    per_layer = 6 if recompute else 4
    return [Collective("all-reduce", ("tp",), per_layer * m.n_layers * act, per_layer * m.n_layers,
                       "block activations: 2 forward + 2 backward per layer"
                       + (" + 2 recomputed" if recompute else "")),
            Collective("all-reduce", ("tp",), 2 * act, 2,
                       "vocab-parallel embedding (fwd) and head input gradient (bwd)"),
            Collective("all-reduce", ("tp",), 3 * stats, 3,
                       "softmax max, sum and target logit over the vocabulary")]
