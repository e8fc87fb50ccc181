import jax
import numpy as np
import pytest

from jaxscale import config as C
from jaxscale import meshes
from jaxscale.mesh import MeshConfig, make_mesh
from tests.helpers import tiny_config


def test_presets_resolve_and_build():
    m = make_mesh(meshes.get("cpu8"))
    assert dict(zip(m.axis_names, m.devices.shape)) == {"dp": 2, "pp": 1, "fsdp": 2, "ep": 1,
                                                         "sp": 1, "tp": 2}
    assert MeshConfig(fsdp=8, dcn_dp=1).resolve(8).fsdp == 8
    assert meshes.get("h100x8x4").resolve(32).nodes == 4


def test_fill_degree():
    assert MeshConfig(dp=-1, tp=2).resolve(8).dp == 4


@pytest.mark.parametrize("cfg, n, msg", [
    (MeshConfig(dp=3, tp=2), 8, "= 6 devices but 8 are present"),
    (MeshConfig(dp=-1, tp=3), 8, "does not divide the 8 devices"),
    (MeshConfig(dp=-1, fsdp=-1), 8, "only one mesh degree may be -1"),
    (MeshConfig(dp=0), 8, "must be positive"),
    (MeshConfig(dp=4, dcn_dp=3), 4, "dcn_dp=3 must be >= 1 and divide dp=4"),
])
def test_bad_meshes(cfg, n, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        cfg.resolve(n)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown mesh preset 'h100x9'; valid: cpu8"):
        meshes.get("h100x9")


def test_hybrid_mesh_groups_simulated_nodes():
    # 2 simulated nodes of 4 devices: dp=2 across nodes, fsdp=4 inside a node.
    m = make_mesh(MeshConfig(dp=2, fsdp=4, dcn_dp=2))
    d = np.vectorize(lambda x: x.id)(m.devices).reshape(2, 4)
    assert sorted(d[0]) == [0, 1, 2, 3] and sorted(d[1]) == [4, 5, 6, 7]
    # dcn split of an inner axis: fsdp=4 with 2 nodes -> each fsdp group spans both nodes
    m2 = make_mesh(MeshConfig(fsdp=4, tp=2, dcn_fsdp=2))
    ids = np.vectorize(lambda x: x.id)(m2.devices).reshape(4, 2)
    assert set(ids[:2].flat) == {0, 1, 2, 3} and set(ids[2:].flat) == {4, 5, 6, 7}


def test_overrides_and_errors():
    cfg = tiny_config("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1", "model.n_layers=3",
                      "optim.lr=0.5", "model.tie_embeddings=true", "model.rope_scaling=llama3",
                      "model.rope_scaling.factor=4")
    assert (cfg.mesh.dp, cfg.model.n_layers, cfg.optim.lr) == (8, 3, 0.5)
    assert cfg.model.tie_embeddings and cfg.model.rope_scaling.factor == 4.0
    assert C.apply_overrides(cfg, ["model=llama3-8b"]).model.vocab_size == 128256
    assert C.apply_overrides(cfg, ["mesh=h100x8"]).mesh.fsdp == 8
    with pytest.raises(KeyError, match="unknown config key 'model.layers'; valid keys here: "
                                       "model.vocab_size"):
        C.apply_overrides(cfg, ["model.layers=2"])
    with pytest.raises(ValueError, match="bad value 'two' for model.n_layers: expected int"):
        C.apply_overrides(cfg, ["model.n_layers=two"])
    with pytest.raises(ValueError, match="must look like key=value"):
        C.apply_overrides(cfg, ["mesh.dp"])
    with pytest.raises(ValueError, match="unknown mesh preset"):
        C.apply_overrides(cfg, ["mesh=nope"])
    with pytest.raises(ValueError, match="unknown experiment 'nope'.*llama_tiny"):
        C.load_experiment("nope")
    assert C.from_dict(C.to_dict(cfg)) == cfg


@pytest.mark.parametrize("overrides, msg", [
    (("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=8"), "model.n_kv_heads=4 is not divisible by mesh.tp=8"),
    (("data.batch_size=6",), "data.batch_size=6 is not divisible by the data-parallel degree "
                             "dp x fsdp = 4"),
    (("mesh.dp=1", "mesh.pp=2", "model.n_layers=3", "plan.stage_layers=2,2"),
     "plan.stage_layers='2,2' sums to 4 layers, but model.n_layers=3"),
    (("model.n_heads=6",), "model.n_heads=6 must be a multiple of model.n_kv_heads=4"),
])
def test_plan_validation_errors(overrides, msg):
    from jaxscale.plan import validate
    with pytest.raises(ValueError, match=msg):
        validate(tiny_config(*overrides), jax.device_count())


def test_rule_conflict_is_an_error():
    from jaxscale.axes import Rules
    r = Rules().add("embed", "fsdp", by="fsdp")
    with pytest.raises(ValueError, match="conflicting sharding rules for logical axis 'embed': "
                                         "fsdp maps it to \\('fsdp',\\), tp to \\('tp',\\)"):
        r.add("embed", "tp", by="tp")
    r.add("batch", ("dp", "fsdp"), by="dp+fsdp")
    assert tuple(r.spec(("batch", "seq", "embed"))) == (("dp", "fsdp"), None, None)
