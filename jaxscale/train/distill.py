"""Distillation during training: a frozen teacher's logits in the student's train step.

`train.teacher=<dir>` names the teacher: a run directory (`config.json` beside `checkpoints/`, or
the `ckpt.dir` its config names), a checkpoint directory (its step directories; the config is
read from the checkpoint's metadata) or one step directory `<ckpt dir>/<step>`; otherwise the
newest finalized step. The teacher is a jaxscale model with its own config (any size; the same
vocabulary and tokenizer as the student), computing in the student's compute dtype.

Only its parameters are restored (Orbax, each device reading its own slices: the teacher's
arrays are sharded by the student's plan rules over the teacher's logical names, like the
student's parameters). They are an argument of the jitted step (`Teacher.bind`), not part of the
train state: not donated, not updated, not checkpointed with the student.

In the step, per micro-batch, the teacher's forward runs on the same tokens (no gradient) and the
student optimises, per real token,

    a x T^2 x KL(softmax(teacher / T) || softmax(student / T)) + (1 - a) x CE(student, target)

(`train.distill_alpha` a, `train.distill_temperature` T; the KL term is `distillation_loss`, the
same objective over token means is `objective`).
Both terms are token sums divided by the batch's real tokens, as the plain loss, so micro-batches
and data-parallel devices average exactly. The step reports `loss` = the cross entropy (what
eval reports) and `distill_kd` = the T^2 KL token mean. Costs: the teacher's parameters on every
device (sharded as the plan shards the student's), one teacher forward per micro-batch (its FLOPs
in the step) and its logits [b, T, V] fp32 kept for the backward.

Refused (`problems`): a missing or empty directory, a teacher with another vocabulary size or a
max_seq_len below data.seq_len, and plans whose step does not run a plain forward (pipeline
mesh.pp > 1, context parallelism mesh.sp > 1, `plan.local_sgd`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale import config as config_lib
from jaxscale.fields import raise_problems
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk


@dataclass
class Teacher:
    cfg: Any                  # the teacher's Config
    model: Any                # its FunctionalModel (the student's compute dtype)
    params: Any               # its parameters, sharded
    shardings: Any            # their NamedShardings
    temperature: float
    alpha: float
    where: str                # the checkpoint step directory restored

    def objective(self, student_logits, ce_sum, batch, teacher_params):
        """(alpha x T^2 KL token sum + (1 - alpha) x CE token sum, the KL token sum) of one
        (micro-)batch, given the student's logits and its CE token sum."""
        t_logits = jax.lax.stop_gradient(self.model.apply(
            teacher_params, batch["inputs"], batch.get("positions"), batch.get("segment_ids")))
        mask = batch["mask"].astype(jnp.float32)
        kd = distillation_loss(student_logits, t_logits, self.temperature, mask)
        kd_sum = kd * jnp.maximum(jnp.sum(mask), 1.0)
        return self.alpha * kd_sum + (1.0 - self.alpha) * ce_sum, kd_sum

    def bind(self, jitted):
        return _Bound(jitted, self.params)


class _Bound:
    """A jitted (state, batch, teacher params) step called as (state, batch)."""

    def __init__(self, jitted, params):
        self.jitted, self.params = jitted, params

    def __call__(self, state, batch):
        return self.jitted(state, batch, self.params)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch, self.params)

    def trace(self, state, batch):
        return self.jitted.trace(state, batch, self.params)


# ----------------------------------------------------------------------------- finding it
def locate(path: str):
    """(checkpoint directory, step or None, the teacher's config dict or None) for a run, a
    checkpoint or a step directory; ValueError naming what is missing."""
    p = Path(path)
    key = f"train.teacher={path!r}"
    if not p.exists():
        raise ValueError(f"{key}: no such directory; give the teacher's run directory (with "
                         f"config.json and checkpoints/) or its checkpoint directory")
    if not p.is_dir():
        raise ValueError(f"{key} is a file; give the teacher's run or checkpoint directory")
    if (p / "config.json").is_file():
        cfg = json.loads((p / "config.json").read_text())
        ck = (cfg.get("ckpt") or {}).get("dir") or str(p / "checkpoints")
        return Path(ck), None, cfg
    if p.name.isdigit() and not ckpt_meta.scan(p).complete:        # one step directory
        run = p.parent.parent / "config.json"
        return p.parent, int(p.name), json.loads(run.read_text()) if run.is_file() else None
    return p, None, None


def problems(cfg, spec, teacher_cfg) -> list[str]:
    """Why this teacher cannot teach this student under this plan (all at once)."""
    errs, key = [], f"train.teacher={cfg.train.teacher!r}"
    tm, sm = teacher_cfg.model, cfg.model
    if tm.vocab_size != sm.vocab_size:
        errs.append(f"{key}: the teacher's vocabulary has {tm.vocab_size} entries, the student's "
                    f"{sm.vocab_size}: distillation compares logits over the same vocabulary "
                    f"(same tokenizer and model.vocab_size)")
    if tm.max_seq_len < cfg.data.seq_len:
        errs.append(f"{key}: the teacher's model.max_seq_len={tm.max_seq_len} is below "
                    f"data.seq_len={cfg.data.seq_len}")
    for axis, what in (("pp", "the pipeline engine"), ("sp", "context parallelism")):
        if spec.deg(axis) > 1:
            errs.append(f"{key} with mesh.{axis}={spec.deg(axis)}: {what} does not run a teacher "
                        f"forward; set mesh.{axis}=1")
    from jaxscale.strategies.tables.params import leaves
    for leaf in leaves(tm):           # the teacher is sharded by the student's rules
        for dim, ax in zip(leaf.shape, leaf.axes):
            split = int(np.prod([spec.deg(m) for m in spec.rules.table.get(ax, ()) or ()]))
            if dim % split:
                errs.append(f"{key}: the teacher's {leaf.path} axis '{ax}' (size {dim}) does not "
                            f"divide over the {split} devices the plan splits '{ax}' into")
                break
    if spec.local_sgd != "none":
        errs.append(f"{key} with plan.local_sgd: its step does not run a teacher; choose one")
    return errs


def load(cfg, placement, policy) -> Teacher:
    """The teacher of `cfg.train.teacher`, its parameters restored in the plan's shards."""
    from jaxscale.strategies.pp.stages import reorder
    from jaxscale.train.state import FunctionalModel
    ckdir, step, tdict = locate(cfg.train.teacher)
    key = f"train.teacher={cfg.train.teacher!r}"
    listing = ckpt_meta.scan(ckdir)
    if step is None:
        if not listing.complete:
            raise ValueError(f"{key}: no finalized checkpoint in {ckdir} (train the teacher "
                             f"first, or give its step directory)")
        step = listing.latest
    ckpt = ckpt_lib.Checkpointer(ckdir, config_lib.CheckpointConfig(async_save=False),
                                 read_only=True)
    try:
        meta = ckpt.read_meta(step)
        tcfg = config_lib.from_dict(tdict if tdict is not None else meta["config"])
        raise_problems(problems(cfg, placement.spec, tcfg))
        model = FunctionalModel(dataclasses.replace(      # padded as the student's plan pads
            tcfg.model, dtype=policy.compute_dtype, param_dtype="float32",
            vocab_multiple=placement.spec.model.vocab_multiple))
        shardings = model.param_shardings(placement)
        leaves = meta["leaves"]
        padded = jax.tree_util.tree_map_with_path(
            lambda path, a, sh: jax.ShapeDtypeStruct(
                a.shape, np.dtype(leaves["params/" + jax.tree_util.keystr(
                    path, simple=True, separator="/")][1]), sharding=sh),
            model.abstract_params, shardings)
        target = disk.disk_abstract(padded, tcfg.model.vocab_size)   # as the checkpoint holds
        ocp = ckpt.ocp                # only the parameters, each device its own slices
        restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
        out = ocp.PyTreeCheckpointer().restore(
            (ckdir / str(step) / "state").absolute(), args=ocp.args.PyTreeRestore(
                item={"params": target}, restore_args={"params": restore_args},
                partial_restore=True))
        params = disk.from_disk(reorder(out["params"], meta.get("layer_order"), None), padded)
    finally:
        ckpt.close()
    return Teacher(tcfg, model, params, shardings, float(cfg.train.distill_temperature),
                   float(cfg.train.distill_alpha), str(ckdir / str(step)))


# ----------------------------------------------------------------------------- the loss
def _concrete(x) -> bool:
    """A Python or NumPy number (checked); traced values (e.g. jit arguments) are not."""
    return isinstance(x, (int, float, np.number))


def distillation_loss(student_logits, teacher_logits, temperature: float = 1.0, mask=None):
    """T^2 x KL(softmax(teacher / T) || softmax(student / T)), token mean over `mask` ([B, T];
    None = every token). No gradient flows into the teacher. `temperature` may be traced."""
    if _concrete(temperature) and not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    t = jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature
    s = student_logits.astype(jnp.float32) / temperature
    logp_t, logp_s = jax.nn.log_softmax(t, -1), jax.nn.log_softmax(s, -1)
    kl = jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s), axis=-1)
    mask = jnp.ones(kl.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return temperature ** 2 * jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def objective(student_logits, teacher_logits, targets, mask=None, alpha: float = 0.5,
              temperature: float = 1.0):
    """alpha x distillation_loss + (1 - alpha) x CE(student, targets), token means (alpha as
    `train.distill_alpha`: the weight of the teacher); returns (loss, {"ce", "kd"})."""
    if _concrete(alpha) and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    ce_tok = optax.softmax_cross_entropy_with_integer_labels(
        student_logits.astype(jnp.float32), targets)
    m = jnp.ones(ce_tok.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    ce = jnp.sum(ce_tok * m) / jnp.maximum(jnp.sum(m), 1.0)
    kd = distillation_loss(student_logits, teacher_logits, temperature, m)
    return alpha * kd + (1 - alpha) * ce, {"ce": ce, "kd": kd}
