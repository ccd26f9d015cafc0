"""Data sets for ``zoomr bench``: shipped copies, $ZOOMR_DATA overrides, JSONL paths, ``--list-datasets``."""

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import resources

import pytest

from conftest import ROOT, zoomr_cmd
from conftest import ENV
from zoomr.evaluation.datasets import KNOWN, DatasetError, list_datasets, load_problems, records

SHIPPED = resources.files("zoomr.evaluation") / "data"


def provenance() -> dict[str, tuple[int, str]]:
    """{file: (problems, sha256)} as the provenance note states them."""
    rows = re.findall(r"^\| `([\w.]+\.jsonl\.gz)` \| (\d+) \|.*\| `([0-9a-f]{64})` \|$",
                      (SHIPPED / "README.md").read_text(), re.M)
    return {f: (int(n), sha) for f, n, sha in rows}


def test_shipped_files_are_what_the_provenance_note_says():
    note = provenance()
    assert sorted(note) == sorted(f"{name}.jsonl.gz" for name in KNOWN)
    for f, (n, sha) in note.items():
        raw = gzip.decompress((SHIPPED / f).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == sha, f
        assert len(raw.decode("utf-8").splitlines()) == n, f


def test_every_name_loads_from_the_package_in_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing beside the checkout or the working folder is consulted
    note = provenance()
    rows = list_datasets()
    assert [r["name"] for r in rows] == list(KNOWN) and {r["source"] for r in rows} == {"shipped"}
    for r in rows:
        name, problems = load_problems(r["name"])
        assert name == r["name"] and len(problems) == r["problems"] == note[f"{name}.jsonl.gz"][0]
        assert all(p.question.strip() and p.gold.strip() for p in problems)
        assert len({p.id for p in problems}) == len(problems)  # resume keys
    by = {r["name"]: r for r in rows}
    assert (by["gsm8k"]["question"], by["gsm8k"]["gold"]) == ("question", "answer (after ####)")
    assert (by["olympiadbench"]["question"], by["olympiadbench"]["gold"]) == ("question", "final_answer")
    assert load_problems("gsm8k", limit=3)[1][0].gold == "18"  # the first GSM8K answer, after its "####"


def test_zoomr_data_overrides_a_name_and_adds_one(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "gsm8k").mkdir(parents=True)
    (first / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n'
                                                '{"question": "2+2?", "answer": "#### 4"}\n')
    for d, q in ((second / "gsm8k", "never read"), (second / "mine", "3+3?")):
        d.mkdir(parents=True)
        (d / "test.jsonl").write_text(json.dumps({"problem": q, "answer": "6"}) + "\n")
    monkeypatch.setenv("ZOOMR_DATA", os.pathsep.join(map(str, (first, second))))
    name, problems = load_problems("gsm8k")
    assert name == "gsm8k" and [p.gold for p in problems] == ["2", "4"]  # the first folder wins
    assert load_problems("mine")[1][0].question == "3+3?"
    by = {r["name"]: r for r in list_datasets()}
    assert by["gsm8k"]["source"] == str(first / "gsm8k" / "test.jsonl") and by["gsm8k"]["problems"] == 2
    assert by["mine"]["source"] == str(second / "mine" / "test.jsonl")
    assert by["math500"]["source"] == "shipped" and by["math500"]["problems"] == len(records("math500"))


def test_jsonl_paths_plain_or_gzipped(tmp_path):
    lines = '{"problem": "1+1?", "answer": "2"}\n{"problem": "2+3?", "answer": "5"}\n'
    (tmp_path / "mine.jsonl").write_text(lines)
    (tmp_path / "mine.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    plain, zipped = load_problems(str(tmp_path / "mine.jsonl")), load_problems(str(tmp_path / "mine.jsonl.gz"))
    assert plain == zipped and plain[0] == "mine" and [p.gold for p in plain[1]] == ["2", "5"]
    (tmp_path / "torn.jsonl.gz").write_bytes(gzip.compress(lines.encode())[:-12])
    with pytest.raises(DatasetError, match="cannot read"):
        load_problems(str(tmp_path / "torn.jsonl.gz"))


@pytest.mark.parametrize("spec,needle", [("gsm9k", "--list-datasets"), ("no/such/folder/gsm8k", "no such"),
                                         ("", "no such")])
def test_unknown_names_are_refused(spec, needle):
    with pytest.raises(DatasetError, match=needle):
        load_problems(spec)


@pytest.mark.slow
def test_list_datasets_cli_prints_every_set_and_exits_before_anything_else(tmp_path):
    # -n 0 would be refused by a run: the listing comes first and loads no model
    r = subprocess.run(zoomr_cmd() + ["bench", "--list-datasets", "--no-live", "-n", "0"], capture_output=True,
                       text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == list_datasets()
    assert "loading" not in r.stderr
    r = subprocess.run(zoomr_cmd() + ["bench", "--list-datasets"], capture_output=True, text=True,
                       env={**ENV, "COLUMNS": "100"}, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    cells = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()}
    for row in list_datasets():
        assert row["name"] in cells, r.stdout
        line = cells[row["name"]]
        assert line[1] == str(row["problems"]) and line[2] == row["question"] and line[-1] == "shipped"


def test_a_non_editable_install_ships_the_sets(tmp_path):
    """What ``pip install .`` puts in site-packages finds every set through importlib.resources alone."""
    src, target = tmp_path / "src", tmp_path / "site"  # built from a copy: the build leaves nothing in the repo
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    for pkg in ("zoomr_cli", "backends", "kvstore", "configs"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-compile", "--target", str(target), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    # one namespace: zoomr imports, the source folders' own names do not exist top-level
    probe = ("import json, importlib.util as u, zoomr.evaluation.datasets as d; "
             "top = [n for n in ('backends', 'kvstore', 'configs', 'zoomr_cli') if u.find_spec(n)]; "
             "print(json.dumps([d.__file__, d.list_datasets(), len(d.load_problems('math500', 2)[1]), top]))")
    env = {k: v for k, v in ENV.items() if k not in ("PYTHONPATH", "ZOOMR_DATA")}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       env={**env, "PYTHONPATH": str(target)}, timeout=120)
    assert r.returncode == 0, r.stderr
    where, rows, n, top = json.loads(r.stdout)
    assert where.startswith(str(target)) and n == 2 and top == []
    assert rows == list_datasets() and {row["source"] for row in rows} == {"shipped"}


def test_a_folder_given_as_dataset_is_named_as_a_folder(tmp_path):
    with pytest.raises(DatasetError, match=r": is a folder; --dataset takes a name \(gsm8k, .*\) or a JSONL file$"):
        load_problems(str(tmp_path))
