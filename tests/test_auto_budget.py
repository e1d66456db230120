"""--dram-budget auto (the default): the machine's room, the memory cgroup's if it is smaller, less a margin."""
import numpy as np

from flashinfer_lite import budget, process
from flashinfer_lite.runtime import load_runtime
from storage.convert import convert


def test_cgroup_room_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text("1073741824\n")
    (v2 / "job" / "memory.current").write_text(str(900 << 20))
    (v2 / "job" / "memory.stat").write_text("anon 1\nfile 104857600\n")
    (tmp_path / "cg2").write_text("0::/job\n")
    assert process.cgroup_room(str(tmp_path / "cg2"), str(v2)) == (1 << 30) - (900 << 20) + (100 << 20)
    (v2 / "job" / "memory.max").write_text("max\n")
    assert process.cgroup_room(str(tmp_path / "cg2"), str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "cap").mkdir(parents=True)
    (v1 / "memory" / "cap" / "memory.limit_in_bytes").write_text(str(512 << 20))
    (v1 / "memory" / "cap" / "memory.usage_in_bytes").write_text(str(500 << 20))
    (v1 / "memory" / "cap" / "memory.stat").write_text("cache 1\ntotal_cache 20971520\n")
    (tmp_path / "cg1").write_text("5:cpu,cpuacct:/x\n4:memory:/cap\n")
    assert process.cgroup_room(str(tmp_path / "cg1"), str(v1)) == (12 << 20) + (20 << 20)
    assert process.cgroup_room(str(tmp_path / "missing"), str(v1)) is None


def test_auto_is_the_whole_model_when_it_fits_else_the_room(tiny_model, tmp_path, monkeypatch, capsys):
    path = convert(tiny_model("llama-relu"), tmp_path / "f", dtype="f16", progress=False)
    ids = np.random.default_rng(6).integers(3, 512, size=6).tolist()

    def run(room):
        monkeypatch.setattr(budget, "auto_budget_bytes", lambda: room)
        model, _, rt = load_runtime(path, "oracle", dram_budget="auto", base_bytes=0)
        kv = model.new_cache(32)
        return np.stack([model.forward([t], kv) for t in ids]), rt

    whole = load_runtime(path, "oracle", base_bytes=0)[2].plan
    want, rt = run(1 << 40)
    assert not rt.plan.requested and rt.plan.budget_bytes == whole.budget_bytes     # fits: no cap at all
    assert "dram budget: auto" not in capsys.readouterr().err
    room = whole.minimum_bytes + (whole.budget_bytes - whole.minimum_bytes) // 4
    got, rt = run(room)
    assert rt.plan.requested and rt.plan.budget_bytes == room                       # does not fit: the room
    assert "dram budget: auto = " in capsys.readouterr().err
    np.testing.assert_array_equal(got, want)                                        # same bits either way


def test_dense_that_does_not_fit_names_what_to_run(tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(budget, "auto_budget_bytes", lambda: 1 << 10)
    load_runtime(tiny_model("llama-relu"), "dense", dram_budget="auto")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "flashinfer-lite collect" in err[0] and "train-predictor" in err[0]
