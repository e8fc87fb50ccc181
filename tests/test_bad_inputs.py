"""Every bad input is one clear error before work starts: exit 2, no traceback, the message names
the field (or flag, or file), and nothing is written. Every case fails in validation, so nothing
here compiles, trains or reads a corpus."""
import dataclasses
import json
import os

import numpy as np
import pytest

from jaxscale import config as C
from jaxscale import fields
from jaxscale.cli import main
from jaxscale.mesh import MeshConfig
from jaxscale.models.llama import ModelConfig, RopeScaling

T = "llama_tiny"
FILE = "{tmp}/a_file.txt"                      # an existing file where a directory is expected
SYNTAX = "{tmp}/syntax_error.py"               # an experiment that does not parse
WRONG_TYPE = "{tmp}/wrong_type.py"             # an experiment whose config has a str seq_len

# (command line, text the message must contain); {tmp} is a fresh directory (also the cwd)
CASES = {
    # ---- the cases of the issue: crashes, then silently accepted
    "seq_len zero": (["train", T, "--set", "data.seq_len=0"],
                     "data.seq_len=0: must be an integer >= 1"),
    "batch zero": (["train", T, "--set", "data.batch_size=0"], "data.batch_size=0: must be"),
    "layers zero": (["train", T, "--set", "model.n_layers=0"], "model.n_layers=0: must be"),
    "out is a file": (["train", T, "--out", FILE],
                      "--out='{tmp}/a_file.txt': exists and is not a directory"),
    "experiment syntax": (["train", SYNTAX], "syntax_error.py:2:"),
    "vocab below tokenizer": (["train", T, "--set", "model.vocab_size=100"],
                              "model.vocab_size=100: must be >= 259"),
    "lr negative": (["train", T, "--set", "optim.lr=-1"], "optim.lr=-1.0: must be a number > 0"),
    "steps negative": (["train", T, "--steps", "-3"], "train.steps=-3 (from --steps): must be"),
    "ckpt every negative": (["train", T, "--set", "ckpt.every=-1"],
                            "ckpt.every=-1: must be an integer >= 0"),
    "profile steps zero": (["profile", T, "--steps", "0"], "argument --steps: invalid value '0'"),
    "plan seq negative": (["plan", "--seq", "-5"], "data.seq_len=-5 (from --seq): must be"),
    "plan batch zero": (["plan", "--batch", "0"], "data.batch_size=0 (from --batch): must be"),
    # ---- zero
    "steps zero": (["train", T, "--steps", "0"], "train.steps=0 (from --steps)"),
    "accumulate zero": (["inspect", T, "--set", "plan.accumulate=0"], "plan.accumulate=0"),
    "eval_batches zero": (["train", T, "--set", "train.eval_batches=0"], "train.eval_batches=0"),
    "log_every zero": (["train", T, "--set", "train.log_every=0"], "train.log_every=0"),
    "n_heads zero": (["inspect", T, "--set", "model.n_heads=0"], "model.n_heads=0"),
    "dcn zero": (["plan", "--set", "mesh.dcn_dp=0"], "mesh.dcn_dp=0"),
    "keep zero": (["train", T, "--set", "ckpt.keep=0"], "ckpt.keep=0"),
    "devices zero": (["inspect", T, "--devices", "0"], "argument --devices"),
    "plan devices zero": (["plan", "--devices", "0"], "argument --devices"),
    "processes zero": (["launch", "--processes", "0", "--", "train", T], "argument --processes"),
    "bench min-bytes zero": (["bench", "collectives", "--min-bytes", "0"], "argument --min-bytes"),
    # ---- negative
    "max_bytes negative": (["train", T, "--set", "data.max_bytes=-1"], "data.max_bytes=-1"),
    "warmup negative": (["train", T, "--set", "optim.warmup_steps=-5"], "optim.warmup_steps=-5"),
    "mesh degree negative": (["inspect", T, "--set", "mesh.dp=-2"],
                             "mesh.dp=-2: must be -1 or an integer >= 1"),
    "eval_every negative": (["profile", T, "--set", "train.eval_every=-1"], "train.eval_every=-1"),
    "local devices negative": (["launch", "--local-devices", "-1", "--", "train", T],
                               "argument --local-devices"),
    "top negative": (["plan", "--top", "-1"], "argument --top"),
    "bench size negative": (["bench", "collectives", "--max-bytes", "-1K"], "argument --max-bytes"),
    "launched steps negative": (["launch", "--", "train", T, "--steps", "-3"], "train.steps=-3"),
    # ---- wrong type
    "seq_len not a number": (["train", T, "--set", "data.seq_len=abc"], "data.seq_len"),
    "seq_len fractional": (["inspect", T, "--set", "data.seq_len=1.5"],
                           "bad value '1.5' for data.seq_len"),
    "bool garbage": (["train", T, "--set", "plan.donate=maybe"], "plan.donate"),
    "lr nan": (["train", T, "--set", "optim.lr=nan"], "optim.lr=nan"),
    "steps not a number": (["train", T, "--steps", "ten"], "argument --steps"),
    "devices not a number": (["profile", T, "--devices", "two"], "argument --devices"),
    "experiment field type": (["inspect", WRONG_TYPE], "data.seq_len='128': must be an integer"),
    "bench size garbage": (["bench", "collectives", "--min-bytes", "lots"], "argument --min-bytes"),
    "bench iters not a number": (["bench", "collectives", "--iters", "x"], "argument --iters"),
    # ---- out of range / not a choice
    "zero stage 4": (["train", T, "--set", "plan.zero=4"],
                     "plan.zero=4: must be an integer between 0 and 3"),
    "precision fp8": (["plan", "--set", "plan.precision=fp8"],
                      "plan.precision='fp8': must be one of fp32, bf16, fp16"),
    "schedule": (["plan", "--set", "plan.schedule=zigzag"], "plan.schedule='zigzag'"),
    "context": (["plan", "--set", "plan.context=spiral"], "plan.context='spiral'"),
    "b2 one": (["train", T, "--set", "optim.b2=1"], "optim.b2=1.0: must be a number >= 0 and < 1"),
    "heldout fraction": (["train", T, "--set", "data.heldout_fraction=1.5"],
                         "data.heldout_fraction=1.5"),
    "attention": (["inspect", T, "--set", "model.attention=flash"], "model.attention='flash'"),
    "dtype": (["inspect", T, "--set", "model.dtype=int8"], "model.dtype='int8'"),
    "device kind": (["plan", "--set", "mesh.device_kind=tpu9"], "mesh.device_kind='tpu9'"),
    "nonfinite": (["train", T, "--set", "train.nonfinite=ignore"], "train.nonfinite='ignore'"),
    "seq over max_seq_len": (["inspect", T, "--set", "data.seq_len=4096"],
                             "data.seq_len=4096 exceeds model.max_seq_len=1024"),
    "rope factors": (["plan", "--set", "model.rope_scaling=llama3",
                      "--set", "model.rope_scaling.high_freq_factor=0.5"],
                     "model.rope_scaling.high_freq_factor=0.5 must be greater"),
    "profile steps 3": (["profile", T, "--steps", "3"], "must be an integer >= 5"),
    "port": (["launch", "--port", "70000", "--", "train", T], "argument --port"),
    "bench min over max": (["bench", "collectives", "--min-bytes", "16M", "--max-bytes", "1K"],
                           "--min-bytes"),
    "bench factor": (["bench", "collectives", "--factor", "1"], "argument --factor"),
    "unknown key": (["plan", "--set", "plan.zeroo=1"], "unknown config key 'plan.zeroo'"),
    "unknown benchmark": (["bench", "nccl"], "unknown benchmark 'nccl'"),
    "launch without train": (["launch", "--", "inspect", T], "give the command to run after --"),
    "max restarts negative": (["launch", "--max-restarts", "-1", "--", "train", T],
                              "argument --max-restarts: invalid value '-1'"),
    "elastic one process": (["launch", "--processes", "1", "--elastic", "--max-restarts", "1",
                             "--", "train", T], "--elastic restarts on the processes left"),
    "elastic without restarts": (["launch", "--elastic", "--", "train", T],
                                 "--elastic acts on a restart: give --max-restarts N"),
    # ---- cluster names and --plan
    "cluster name incomplete": (["plan", "--mesh", "h100x8x"],
                                "unknown mesh preset 'h100x8x'; valid: cpu8"),
    "cluster kind": (["train", T, "--set", "mesh=h900x8x2"], "unknown device kind 'h900'"),
    "cluster degrees": (["plan", "--mesh", "h100x8x8", "--set", "mesh.tp=8"],
                        "= 512 devices but 64 are present"),
    "plan choice": (["train", T, "--plan", "fastest"], "argument --plan: invalid choice"),
    # ---- missing path
    "no such experiment": (["inspect", "{tmp}/nothere.py"],
                           "unknown experiment '{tmp}/nothere.py'"),
    "glob matches nothing": (["train", T, "--set", "data.source={tmp}/corpus/*.txt"],
                             "the glob '{tmp}/corpus/*.txt' matches no file"),
    "profile glob": (["profile", T, "--set", "data.source=nope/**/*.md"],
                     "data.source='nope/**/*.md'"),
    # ---- wrong kind of path
    "ckpt dir is a file": (["train", T, "--set", "ckpt.dir=" + FILE],
                           "ckpt.dir='{tmp}/a_file.txt': exists and is not a directory"),
    "out under a file": (["train", T, "--out", FILE + "/run"],
                         "cannot be created, '{tmp}/a_file.txt' is a file"),
    # as root every path passes os.access: the directory is made (and removed) where it would go
    "out under /proc": (["train", T, "--out", "/proc/no/such/dir"],
                        "--out='/proc/no/such/dir': cannot be created in '/proc'"),
    "train.out is a file": (["train", T, "--set", "train.out=" + FILE],
                            "train.out='{tmp}/a_file.txt'"),
    "profile out is a file": (["profile", T, "--out", FILE], "--out='{tmp}/a_file.txt'"),
    "plan out is a file": (["plan", "--out", FILE], "--out='{tmp}/a_file.txt'"),
    "bench out is a file": (["bench", "collectives", "--out", FILE], "--out='{tmp}/a_file.txt'"),
    "glob is a directory": (["train", T, "--set", "data.source={tmp}"],
                            "is a directory: add a pattern"),
    "launched out is a file": (["launch", "--", "train", T, "--out", FILE],
                               "--out='{tmp}/a_file.txt'"),
    "offload_dir is a file": (["train", T, "--set", "plan.precision=bf16", "--set",
                               "plan.offload=optimizer+master", "--set", "plan.offload_tier=nvme",
                               "--set", "plan.offload_dir=" + FILE],
                              "plan.offload_dir='{tmp}/a_file.txt' is a file, not a directory"),
    # ---- settings that disagree with the command
    "slow worker that does not exist": (["launch", "--async", "2", "--", "train", T, "--set",
                                         "ps.slow=9:2"],
                                        "ps.slow='9:2' names worker 9, but --async 2 starts "
                                        "only workers 0 and 1"),
    "prepare max bytes twice": (["data", "prepare", T, "--set", "data.max_bytes=20000",
                                 "--max-bytes", "30000", "--out", "{tmp}/shards"],
                                "--max-bytes 30000 and --set data.max_bytes=20000 disagree"),
    # ---- corrupt file (the Hugging Face ones are below: no subcommand reads them)
    "experiment indentation": (["plan", "--experiment", "{tmp}/indent_error.py"],
                               "indent_error.py:3:"),
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh current directory holding the files the cases point at (default outputs such as
    runs/<name> would land here too)."""
    (tmp_path / "a_file.txt").write_text("not a directory\n")
    (tmp_path / "syntax_error.py").write_text("from jaxscale.config import Config\n"
                                              "def config(:\n    return Config()\n")
    (tmp_path / "indent_error.py").write_text("def config():\n    x = 1\n      return x\n")
    (tmp_path / "wrong_type.py").write_text(
        "import dataclasses\nfrom jaxscale import config as C\n\n"
        "def config():\n    cfg = C.load_experiment('llama_tiny')\n"
        "    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len='128'))\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def run(argv):
    try:
        return main(argv)
    except SystemExit as e:          # argparse errors
        return e.code


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_error_and_writes_nothing(case, workdir, capsys):
    argv, expect = CASES[case]
    fill = lambda s: s.replace("{tmp}", str(workdir))      # noqa: E731
    before = _tree(workdir)
    assert run([fill(a) for a in argv]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert fill(expect) in out.err
    assert "error:" in out.err
    assert _tree(workdir) == before, "something was written before the error"


def test_every_problem_at_once(workdir, capsys):
    assert run(["train", T, "--steps", "-1", "--set", "data.seq_len=0", "--set", "optim.lr=0",
                "--set", "model.nlayers=2", "--set", "ckpt.every=-5", "--out",
                str(workdir / "a_file.txt")]) == 2
    err = capsys.readouterr().err
    for text in ("train.steps=-1", "data.seq_len=0", "optim.lr=0.0", "unknown config key "
                 "'model.nlayers'", "ckpt.every=-5", "--out="):
        assert text in err
    assert err.count("\n  - ") == 6


def test_valid_inputs_still_pass_the_checks():
    for name in C.list_experiments():
        assert C.check(C.load_experiment(name)) == []
    assert C.check(C.Config()) == []
    assert C.apply_overrides(C.Config(), ["data.max_bytes=16e6"]).data.max_bytes == 16_000_000


# ----------------------------------------------------------------------------- the mechanism
CONFIG_CLASSES = (C.DataConfig, C.OptimConfig, C.PlanConfig, C.TrainConfig, C.CheckpointConfig,
                  C.PsConfig, ModelConfig, RopeScaling, MeshConfig)
#: strings with no closed set of values (paths, names, or parsed by their strategy module)
FREE_STRINGS = {"source", "loss_scale", "remat", "offload", "out", "dir", "tokenizer", "text_field",
                "shards", "prune", "teacher", "stage_layers", "offload_dir", "zeropp", "slow"}


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_declares_its_range(cls):
    for f in dataclasses.fields(cls):
        t = fields._hints(cls)[f.name]
        if t in (int, float) or (t is str and f.name not in FREE_STRINGS):
            assert fields._KEY in f.metadata, f"{cls.__name__}.{f.name} declares no range"


def test_fields_api(tmp_path, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Inner:
        k: int = fields.ranged(2, lo=1, hi=4)

    @dataclasses.dataclass(frozen=True)
    class Outer:
        n: int = fields.positive(1)
        x: float = fields.nonneg(0.5)
        mode: str = fields.one_of("a", "a", "b")
        opt: float | None = None
        inner: Inner = dataclasses.field(default_factory=Inner)

        def relations(self):
            k = self.inner.k
            return [f"n={self.n} must be <= inner.k={k}"] if self.n > k else []

    assert fields.problems(Outer()) == []
    assert fields.problems(Outer(n=0, x=-1.0, mode="c", opt="1", inner=Inner(k=9)), "o.") == [
        "o.n=0: must be an integer >= 1", "o.x=-1.0: must be a number >= 0",
        "o.mode='c': must be one of a, b", "o.opt='1': must be a number",
        "o.inner.k=9: must be an integer between 1 and 4"]
    assert fields.problems(Outer(n=True)) == ["n=True: must be an integer >= 1"]
    assert fields.problems(Outer(n=3, inner=Inner(k=2))) == ["n=3 must be <= inner.k=2"]
    assert fields.check(Outer, "n", 0, "o.n", via="--n") == \
        "o.n=0 (from --n): must be an integer >= 1"
    assert fields.check(Outer, "n", 5, "o.n") is None
    parse = fields.arg(lo=3, note="why")
    assert parse("3") == 3
    import argparse
    for bad in ("2", "x", "3.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="must be an integer >= 3 \\(why\\)"):
            parse(bad)
    with pytest.raises(ValueError, match="invalid config:\n  - a\n  - b"):
        fields.raise_problems(["a", "b"])
    assert fields.dir_problem(tmp_path, "d") is None
    assert fields.dir_problem(tmp_path / "new" / "deeper", "d") is None
    (tmp_path / "f").write_text("")
    assert "exists and is not a directory" in fields.dir_problem(tmp_path / "f", "d")
    assert "is a file" in fields.dir_problem(tmp_path / "f" / "sub", "d")
    # a path that cannot be created even by root: below a regular file of the system
    assert fields.dir_problem("/proc/version/run", "d") == \
        "d='/proc/version/run': cannot be created, '/proc/version' is a file"
    # a directory without write permission. Root may write anywhere (CI runs as root), so the
    # permission check an ordinary user gets, from the mode bits, stands in for os.access there
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    real_access = os.access

    def user_access(path, mode):
        denied = mode & os.W_OK and not os.stat(path).st_mode & 0o200
        return real_access(path, mode) and not denied
    monkeypatch.setattr(fields.os, "access", user_access)
    try:
        assert fields.dir_problem(ro, "d") == f"d={str(ro)!r}: the directory is not writable"
        assert fields.dir_problem(ro / "run", "d") == \
            f"d={str(ro / 'run')!r}: cannot be created, {str(ro)!r} is not writable"
        assert fields.dir_problem(tmp_path / "new", "d") is None      # writable: no problem
    finally:
        ro.chmod(0o700)
    assert not (tmp_path / "new").exists()


def test_model_validate_reports_ranges_without_dividing_by_zero():
    with pytest.raises(ValueError, match="model.n_kv_heads=0: must be an integer >= 1"):
        ModelConfig(n_kv_heads=0).validate()
    with pytest.raises(ValueError, match="model.n_heads=0.*; model.n_kv_heads=0"):
        ModelConfig(n_heads=0, n_kv_heads=0).validate()


# ----------------------------------------------------------------------------- Hugging Face
def _hf_dir(path, sharded=False):
    """A small LLaMA directory (config.json + safetensors) without torch."""
    from safetensors.numpy import save_file

    from jaxscale.interop import hf, hf_config
    cfg = ModelConfig(vocab_size=320, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config.config_to_hf(cfg)))
    tensors = {"model.embed_tokens.weight": np.zeros((320, 32), np.float32),
               "model.norm.weight": np.ones((32,), np.float32)}
    if sharded:
        names = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                 "model.norm.weight": "model-00002-of-00002.safetensors"}
        for n, f in names.items():
            save_file({n: tensors[n]}, str(path / f))
        (path / hf.INDEX_FILE).write_text(json.dumps({"weight_map": names}))
    else:
        save_file(tensors, str(path / hf.SINGLE_FILE))
    return path


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def test_hf_good_directory_opens(tmp_path):
    from jaxscale.interop import hf
    assert set(hf.Checkpoint(_hf_dir(tmp_path / "a")).weight_map) == {
        "model.embed_tokens.weight", "model.norm.weight"}
    assert len(set(hf.Checkpoint(_hf_dir(tmp_path / "b", sharded=True)).weight_map.values())) == 2


@pytest.mark.parametrize("damage, error, match", [
    ("truncate single", ValueError,
     r"model\.safetensors: not a readable safetensors file .*truncated or corrupt"),
    ("truncate shard", ValueError,
     r"model-00002-of-00002\.safetensors: not a readable safetensors"),
    ("missing shard", FileNotFoundError,
     r"names model-00001-of-00002\.safetensors, which is not in"),
    ("broken config", ValueError, r"config\.json: not valid JSON: .* at line 2 column 1"),
    ("broken index", ValueError, r"model\.safetensors\.index\.json: not valid JSON"),
    ("config not an object", ValueError, r"config\.json: expected a JSON object, got list"),
    ("only pytorch_model.bin", FileNotFoundError,
     r"pytorch_model\.bin: PyTorch pickle \(\.bin\) files are not read.*save_pretrained"),
])
def test_hf_bad_directory_is_a_named_error(tmp_path, damage, error, match):
    from jaxscale.interop import hf
    d = _hf_dir(tmp_path / "m", sharded=damage in ("truncate shard", "missing shard",
                                                   "broken index"))
    if damage == "truncate single":
        _truncate(d / hf.SINGLE_FILE)
    elif damage == "truncate shard":
        _truncate(d / "model-00002-of-00002.safetensors")
    elif damage == "missing shard":
        (d / "model-00001-of-00002.safetensors").unlink()
    elif damage == "broken config":
        (d / "config.json").write_text('{"vocab_size": 320,\n')
    elif damage == "broken index":
        (d / hf.INDEX_FILE).write_text('{"weight_map": {')
    elif damage == "config not an object":
        (d / "config.json").write_text("[1, 2]")
    else:
        (d / hf.SINGLE_FILE).unlink()
        (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch pickle")
    with pytest.raises(error, match=match):
        hf.load(d, C.Config())
