"""The faulty/clean program set on the emulator (CPU): every faulty program's replay differs from
eager exactly as predicted, every clean twin replays bit for bit as eager, host syncs raise at
capture. The same programs run under CUDA graphs in ``ci/gpu/graph_agreement.py``.

Covers: a Python int frozen at capture (slice bound, Triton grid and count), a host 0-dim tensor
frozen at capture, a buffer rebound after capture, a tail not reset (small batch after a large
one), host syncs (.item(), x[mask], torch.tensor(list, device=...)); the clean twins; views,
in-place, out=, tuples, RNG and pinned copies inside a graph.
"""

import os

import graph_programs as gp
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

pytestmark = pytest.mark.cudagraph

TRITON_OK = gp.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"


def _skip_unless_runnable(prog):
    if prog.needs_triton and not TRITON_OK:
        pytest.skip("needs Triton under TRITON_INTERPRET=1")


@pytest.mark.parametrize("name", [p.name for p in gp.PROGRAMS])
def test_program_replays_as_predicted_on_the_emulator(name):
    prog = gp.BY_NAME[name]
    _skip_unless_runnable(prog)
    run = gp.run_program(prog, "cpu", None, seed=11)
    assert run.kind == "emulated"
    assert gp.check_run(prog, run) == []


def test_every_fault_kind_has_a_program_and_every_faulty_program_a_clean_twin():
    kinds = {p.fault for p in gp.PROGRAMS if p.fault}
    assert kinds == set(gp.FAULTS)
    for prog in gp.PROGRAMS:
        if prog.fault:
            twin = gp.BY_NAME[prog.twin]
            assert twin.fault is None, f"{prog.name}'s twin {twin.name} is faulty"


def test_a_frozen_scalar_replays_the_capture_size_after_a_smaller_batch():
    # The predicted fault, spelled out once: rows past the live count are computed anyway.
    prog = gp.BY_NAME["frozen_scalar"]
    run = gp.run_program(prog, "cpu", None, seed=2, sizes=(8, 3))
    replay, eager = run.replay[1], run.eager[1]
    assert gp.same(replay[:3], eager[:3])
    assert (eager[3:] == 0).all() and (replay[3:] == 1.0).all()  # x tail is zero: 0 * w + 1


def test_a_stale_tail_is_read_after_a_larger_batch():
    prog = gp.BY_NAME["stale_tail"]
    run = gp.run_program(prog, "cpu", None, seed=4, sizes=(8, 2))
    assert not gp.same(run.replay[1][2:], run.eager[1][2:])  # rows 2..7 still hold batch 8's data
    assert (run.eager[1][2:] == 0).all()


_CLEAN = [p.name for p in gp.PROGRAMS if p.fault is None and not p.needs_triton]
_FAULTY = [p.name for p in gp.PROGRAMS if p.fault in ("frozen_scalar", "reallocated_buffer", "stale_tail")
           and not p.needs_triton]


@given(data=st.data())
@example(data=None)  # regression shape: the capture size replayed first, then 1 row
def test_any_batch_sequence_replays_as_predicted(data):
    if data is None:
        name, sizes, seed = "stale_tail", (8, 1), 0
    else:
        name = data.draw(st.sampled_from(_CLEAN + _FAULTY), label="program")
        sizes = tuple(data.draw(st.lists(st.integers(1, gp.C), min_size=1, max_size=4), label="sizes"))
        seed = data.draw(st.integers(0, 2**16), label="seed")
    prog = gp.BY_NAME[name]
    run = gp.run_program(prog, "cpu", None, seed=seed, sizes=sizes)
    assert run.error is None
    if prog.fault is None:
        bad = [i for i, (r, e) in enumerate(zip(run.replay, run.eager)) if not gp.same(r, e)]
        assert bad == [], f"{name}: replay != eager at steps {bad} (sizes={sizes}, seed={seed})"
    else:
        bad = [i for i, (r, p) in enumerate(zip(run.replay, run.predicted)) if not gp.same(r, p)]
        assert bad == [], f"{name}: replay != predicted at steps {bad} (sizes={sizes}, seed={seed})"
