"""A first use's compile children (warmup.compile_in_child): the exact gate's coefficients step, compiled alone with
an empty Numba cache, stays within warmup.COMPILE_CHILD_BYTES, what a memory cgroup must leave beside the run. With
its kernel over every block kind the step took 359 MiB, and the README's first command, cold in a 300 MiB cgroup,
thrashed for more than ten minutes in a compile child; kernels per kind (kernels.neurons.gate_coefficients_for)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Between the step as it is (252 MiB on SmolLM2's q4_1 FLASHDIR, 251 on this one) and as it was when its kernel held
# every kind's loops: 359 MiB (SmolLM2's; 358 on this one), 484 with two such kernels in one step (a prompt's rows)
STEP_BOUND = 300 << 20


@pytest.fixture(scope="module")
def q4_1_flashdir(tiny_model, tmp_path_factory):
    """A GGUF of SmolLM2's kinds (q4_1 gate, up and down), converted: the split layout, its down columns."""
    from conftest import write_llama_gguf
    from storage.checkpoint import open_checkpoint
    from storage.convert import convert
    src = open_checkpoint(tiny_model("llama-silu-gqa"))
    root = tmp_path_factory.mktemp("q4_1-parts")
    types = {f"layers.{i}.ffn.{m}.weight": "Q4_1" for i in range(src.config.n_layers) for m in ("gate", "up", "down")}
    return convert(write_llama_gguf(src, root / "q4_1.gguf", types), root / "flash", progress=False)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB (Linux)")
def test_the_gate_coefficients_step_compiles_in_a_small_child(q4_1_flashdir, tmp_path):
    from flashinfer_lite.warmup import COMPILE_CHILD_BYTES, compile_steps
    from storage.format import read_layout
    layout = read_layout(q4_1_flashdir)
    assert layout.parts and layout.down_column(0) == "q4_1"
    names = [s.__name__ for s in compile_steps(layout)]
    step = next(i for i, n in enumerate(names) if n.startswith("gate (coefficients"))
    # a process of its own whose only child is the step: RUSAGE_CHILDREN's peak is that child's
    peak_of_child = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                     "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", peak_of_child, sys.executable, "-m", "flashinfer_lite.warmup",
                        str(q4_1_flashdir), str(step)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    peak = int(r.stdout.split()[-1]) << 10
    assert peak <= COMPILE_CHILD_BYTES, (names[step], peak >> 20)
    assert peak < STEP_BOUND, (names[step], peak >> 20)


@pytest.mark.parametrize("room", [1 << 40, 1 << 30])
def test_every_step_compiles_in_one_child_only_where_the_room_holds_it(q4_1_flashdir, monkeypatch, room):
    """compile_in_child starts one child for every step when the room (a cgroup's, else the machine's available
    memory) holds ONE_CHILD_ROOM_BYTES, else a child per step; the last child leaves the stamp."""
    from flashinfer_lite import warmup
    from storage.format import read_layout
    layout = read_layout(q4_1_flashdir)
    n, started = len(warmup.compile_steps(layout)), []

    class Child:
        pid = 0

        def __init__(self, args, **kw):
            started.append(args[3:])

        def wait(self):
            return 0
    monkeypatch.setattr(warmup, "room_bytes", lambda: room)
    monkeypatch.setattr(subprocess, "Popen", Child)
    warmup.compile_in_child(layout)
    one = room >= warmup.ONE_CHILD_ROOM_BYTES
    assert one == (room == 1 << 40)
    steps = [s[1] for s in started]
    assert steps == ([",".join(map(str, range(n)))] if one else [str(i) for i in range(n)])
    assert [s[2] for s in started] == [""] * (len(started) - 1) + ["stamp"]
