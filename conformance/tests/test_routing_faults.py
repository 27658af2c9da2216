"""DeepSeek-V3's routing faults (``moelora_conformance.faulty.routing_faults``) are caught: each reader
fault by ``hf-check``'s reader rows (and the shared-expert scaling by ``checkpoint-pass``), each engine
fault by the engine's comparison with HF + PEFT (``packages/runner/tests/test_engine_deepseek_v3.py``;
``conformance/docs/mutations.md`` has the catch times).
The right reader and engine pass the same checks (``test_deepseek_v3_checkpoint.py``,
``test_engine_deepseek_v3.py``).
"""

import pytest

from moelora_conformance.checkpoint_pass.run import run_model
from moelora_conformance.faulty.routing_faults import READER_FAULTS, faulty_reader
from moelora_conformance.fixtures.specs import DEEPSEEK_V3
from moelora_conformance.hf_check import check_model_base

MODEL = DEEPSEEK_V3.name


@pytest.mark.parametrize("fault", READER_FAULTS)
def test_hf_check_catches_each_reader_fault(fixture_set, fault):
    with faulty_reader(fault):
        rows = check_model_base(fixture_set, MODEL)
    bad = {(r.source, r.part) for r in rows if not r.ok}
    assert bad and {s for s, _ in bad} == {"readers"}, bad  # the in-memory side stays right
    want = "moe" if fault == "scaling-on-shared" else "routing"
    assert ("readers", want) in bad, bad


def test_checkpoint_pass_catches_the_shared_expert_scaling(fixture_set, tmp_path):
    # routing in the pass is the checkpoint's own router (transformers'): only the shared-expert fault reaches it
    with faulty_reader("scaling-on-shared"):
        rows = run_model(fixture_set, tmp_path, MODEL, backends=["reference"], modes=["eager"], num_requests=36)
    assert {r.part for r in rows if not r.ok} == {"shared_down"}
