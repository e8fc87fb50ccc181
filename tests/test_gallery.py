"""The experiments gallery: runs experiment scripts, keeps their claims, tables and figures, and
fails loudly, naming the experiment, when one breaks."""
import json
import textwrap

import pytest

from jaxscale import gallery

GOOD = '''
import argparse, json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
ap = argparse.ArgumentParser(); ap.add_argument("--out"); out = ap.parse_args().out
print("title of the table")
print("plan   bytes")
print("-----  -----")
print("dp8    1,024")
print()
print("claims")                 # printed by Claims.finish: shown from results.json instead
print("claim            result")
print("---------------  ------")
print("bytes = formula  ok")
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
plt.plot([1, 2]); plt.savefig(os.path.join(out, "fig.png"))
json.dump({"claims": [{"claim": "bytes = formula", "measured": "1024", "expected": "1024",
                       "ok": True}]}, open(os.path.join(out, "results.json"), "w"))
'''
BROKEN = '''
raise RuntimeError("this experiment is broken")
'''


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "07_good.py").write_text(textwrap.dedent(GOOD))
    (tmp_path / "experiments" / "12_broken.py").write_text(BROKEN)
    return tmp_path


def test_gallery_keeps_claims_table_and_figure_and_fails_loudly(tree, capsys):
    rc = gallery.run(["07"], False, str(tree / "runs"), tree=tree)
    assert rc == 0
    readme = (tree / "runs" / "README.md").read_text()
    assert "| bytes = formula | 1024 | 1024 | ok |" in readme
    assert "dp8    1,024" in readme and "title of the table" in readme
    assert "bytes = formula  ok" not in readme      # the printed claims are not the key table
    assert (tree / "runs" / "img" / "07_good.png").stat().st_size > 0
    assert "](img/07_good.png)" in readme
    assert "| [12 Gradient compression](#12-gradient-compression) | "\
           "[12_broken.py](../experiments/12_broken.py) | not run |" in readme
    assert not (tree / "experiments" / "README.md").exists()    # running is not publishing

    rc = gallery.run(["12_broken"], False, str(tree / "runs"), tree=tree)
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: 12_broken.py" in out
    readme = (tree / "runs" / "README.md").read_text()
    assert "this experiment is broken" in readme and "**FAILED** (exit 1)" in readme
    assert "| bytes = formula |" in readme         # the earlier entry is kept
    db = json.loads((tree / "runs" / "gallery.json").read_text())
    assert set(db) == {"07", "12"} and db["12"]["failed"] and not db["07"]["failed"]
    assert set(tree.joinpath("experiments").iterdir()) == {tree / "experiments" / "07_good.py",
                                                           tree / "experiments" / "12_broken.py"}
    # --all over a tree without every topic: the missing ones are named and the run fails
    assert gallery.run([], True, str(tree / "runs"), tree=tree) == 1
    assert "topics without an experiment: 01, 02" in capsys.readouterr().out


def test_publish_merges_the_run_into_the_committed_gallery(tree):
    (tree / "experiments" / "gallery.json").write_text(json.dumps({"12": {
        "topic": 12, "script": "experiments/12_broken.py", "rc": 0, "seconds": 1.0,
        "cpu_seconds": 1.0, "over_budget": False, "failed": False, "claims": "",
        "table": "kept from before", "figure": None, "tail": "", "date": "2026-01-01",
        "machine": "m"}}))
    assert gallery.run(["07"], False, str(tree / "runs"), tree=tree, publish=True) == 0
    readme = (tree / "experiments" / "README.md").read_text()
    assert "| bytes = formula | 1024 | 1024 | ok |" in readme and "kept from before" in readme
    assert "[07_good.py](07_good.py)" in readme and "](img/07_good.png)" in readme
    assert (tree / "experiments" / "img" / "07_good.png").stat().st_size > 0
    db = json.loads((tree / "experiments" / "gallery.json").read_text())
    assert set(db) == {"07", "12"}


def test_unknown_experiment_names_the_valid_ones(tree):
    with pytest.raises(SystemExit, match="unknown experiment '99'; valid: 07, 12"):
        gallery.run(["99"], False, str(tree / "runs"), tree=tree)
