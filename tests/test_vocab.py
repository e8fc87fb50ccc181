"""Any vocabulary with tensor parallelism: the embedding and head padded to a multiple of tp, the
padding masked out of the softmax, checkpoints and exports at the true size."""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxscale import plan
from jaxscale.analysis.validation import tiny_config
from jaxscale.data import Batches, load_corpus
from jaxscale.interop import hf
from jaxscale.train import checkpoint as ckpt_lib
from jaxscale.train import checkpoint_meta as ckpt_meta
from jaxscale.train import disk
from jaxscale.train.setup import build
from tests import numerics

ODD = ("model.vocab_size=777",)           # 3 x 7 x 37: no tp divides it
MIX = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")


@pytest.fixture(scope="module")
def mixed():
    return numerics.run((*MIX, *ODD))


def test_the_plan_pads_the_vocabulary_to_a_multiple_of_tp():
    spec = plan.validate(tiny_config(*MIX, *ODD), 8)
    assert spec.model.vocab_size == 777 and spec.model.padded_vocab == 778
    assert plan.validate(tiny_config("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4",
                                     "model.n_kv_heads=4", *ODD), 8).model.padded_vocab == 780
    assert plan.validate(tiny_config("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", *ODD),
                         8).model.padded_vocab == 777          # tp = 1: none


def test_an_odd_vocabulary_on_tp_trains_as_one_device(mixed):
    """3 updates at vocabulary 777 padded to 778 on dp2 x fsdp2 x tp2 against one device at 777
    (compared at the true vocabulary): the padded logits take no probability, so losses,
    gradients and weights are one device's (FP32)."""
    numerics.assert_matches(mixed, numerics.one_device(*ODD))


def test_the_padding_gets_no_gradient(mixed):
    setup = mixed.setup
    state = setup.init_state()
    batch = {k: jax.device_put(v, setup.batch_shardings()[k]) for k, v in
             Batches(load_corpus(setup.cfg.data).train, 8, 32,
                              seed=0).global_rows(0).items()}
    grads = jax.device_get(setup.jit_grads()(state.params, batch)[0])
    assert grads["embed"].shape == (778, 128) and grads["head"].shape == (128, 778)
    assert not np.any(grads["embed"][777:]) and not np.any(grads["head"][:, 777:])
    assert np.any(grads["head"][:, :777])


def test_a_checkpoint_holds_the_true_vocabulary_and_restores_onto_another_mesh(mixed, tmp_path):
    setup = mixed.setup
    state = setup.init_state()
    kept = disk.to_disk(state, 777)
    assert kept.params["embed"].shape == (777, 128) and kept.master is None
    mu = kept.opt_state[1][0].mu                       # clip, then AdamW's moments
    assert mu["embed"].shape == (777, 128) and mu["head"].shape == (128, 777)
    ck = ckpt_lib.Checkpointer(tmp_path, setup.cfg.ckpt)
    ck.save(0, kept, ckpt_meta.make_meta(setup.cfg, kept, 0))
    ck.wait()
    ck.close()
    one = build(tiny_config("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", *ODD),
              jax.devices()[:1])
    ck, restored, _, _ = ckpt_lib.restore_latest(tmp_path, one.cfg.ckpt, one.cfg,
                                                 one.abstract_state())
    ck.close()
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(kept.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and back onto a padded mesh: the padding comes back as zeros
    ck, again, _, _ = ckpt_lib.restore_latest(tmp_path, setup.cfg.ckpt, setup.cfg,
                                              setup.abstract_state())
    ck.close()
    embed = np.asarray(again.params["embed"])
    assert embed.shape == (778, 128) and not np.any(embed[777:])
    np.testing.assert_array_equal(embed[:777], np.asarray(kept.params["embed"]))


def test_an_export_holds_the_true_vocabulary(mixed, tmp_path):
    setup = mixed.setup
    files = hf.export(tmp_path, setup.init_state().params, setup.cfg.model)
    tensors = load_file(str(files[1]))
    assert tensors["model.embed_tokens.weight"].shape == (777, 128)
    assert tensors["lm_head.weight"].shape == (777, 128)
    assert json.loads(files[0].read_text())["vocab_size"] == 777


def test_an_odd_vocabulary_loads_from_hugging_face_onto_a_tp_mesh(mixed, tmp_path):
    setup = mixed.setup
    params = setup.init_state().params
    hf.export(tmp_path, params, setup.cfg.model)
    loaded = hf.load(tmp_path, cfg=tiny_config(*MIX, *ODD))
    assert loaded.params["embed"].shape == (778, 128)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
