"""P06: static-buffer addresses stay fixed across batches; decode and prefill families share no
storage.

In a graph family, every device tensor of the metadata ``prepare(batch, family)`` returns (its
private metadata included) is a view of a static buffer a captured graph reads: its address must not
change from batch to batch, nor may the host numbers a launch uses (``num_tokens``,
``num_segments``, ``max_len``: capacities fixed at capture). A smaller bucket of the family
(``prepare(batch, family, bucket=...)``) reads views of the same buffers: each of its tensors starts
where the family's does and is no longer, and its host numbers are no larger. Where the backend
declares both families, no byte of one family's metadata storage may belong to the other's, and
preparing a batch in the other family leaves this family's buffers exactly as they were.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness.layer import Layer
from moelora_conformance.harness.metadata import metadata_tensors
from moelora_conformance.properties.history import draw_batch
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import capacity_for, draw_case, not_fallback, trace
from moelora_core.batch import BatchSpec
from moelora_core.forward_mode import ForwardMode

HOST_FIELDS = ("num_tokens", "num_segments", "max_len")


def _storages(info):
    out = {}
    for name, t in metadata_tensors(info).items():
        s = t.untyped_storage()
        out[name] = (s.data_ptr(), s.data_ptr() + s.nbytes())
    return out


@conformance("P06")
@given(data=st.data())
def test_static_buffers_keep_their_addresses(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    family = mode
    case = draw_case(data, suite, family, dtype)
    layer = Layer(suite.factory, case, suite.device)
    backend = layer.backend
    batches = [case.batch] + [draw_batch(data, suite, case.batch, family, label=f"batch {i}") for i in range(3)]
    cap = capacity_for(family, batches)
    trace(f"capacity: {cap}; batches: {[b.bs for b in batches]} requests")
    backend.init_graph(family, cap)
    first = not_fallback(backend.prepare(batches[0], family), f"{family} batch 0")
    ptrs = {n: t.data_ptr() for n, t in metadata_tensors(first).items()}
    host = {f: getattr(first, f) for f in HOST_FIELDS}
    for i, batch in enumerate(batches[1:], 1):
        info = not_fallback(backend.prepare(batch, family), f"{family} batch {i}")
        now = {n: t.data_ptr() for n, t in metadata_tensors(info).items()}
        if now != ptrs:
            moved = sorted(n for n in set(ptrs) | set(now) if ptrs.get(n) != now.get(n))
            raise AssertionError(f"{family} batch {i}: metadata tensors moved or appeared: {moved} | {case.describe()}")
        now_host = {f: getattr(info, f) for f in HOST_FIELDS}
        if now_host != host:
            raise AssertionError(f"{family} batch {i}: host numbers changed {host} -> {now_host} (capacities are "
                                 f"fixed at capture) | {case.describe()}")
    bucket = capacity_for(family, batches[:1])
    small = not_fallback(backend.prepare(batches[0], family, bucket), f"{family} batch 0 in the bucket {bucket}")
    full = metadata_tensors(first)
    for n, t in metadata_tensors(small).items():
        if n not in full or t.data_ptr() != full[n].data_ptr() or t.numel() > full[n].numel():
            raise AssertionError(f"{family} bucket {bucket}: {n} is not a view of the family's buffer (address "
                                 f"{t.data_ptr():#x}, {t.numel()} elements) | {case.describe()}")
    if any(getattr(small, f) > host[f] for f in HOST_FIELDS):
        raise AssertionError(f"{family} bucket {bucket}: host numbers {[getattr(small, f) for f in HOST_FIELDS]} "
                             f"exceed the family's {host} | {case.describe()}")
    other = "prefill" if family == "decode" else "decode"
    if other not in suite.capabilities.graph_families:
        return
    snapshot = {n: t.clone() for n, t in metadata_tensors(info).items()}
    mine = _storages(info)
    kind = ForwardMode.DECODE if other == "decode" else ForwardMode.EXTEND
    b = case.batch
    same_kind = (b.forward_mode is ForwardMode.DECODE) == (kind is ForwardMode.DECODE)
    like = b if same_kind else BatchSpec(ForwardMode.IDLE, (), b.max_loras, b.lora_ranks, b.scalings)
    other_batch = draw_batch(data, suite, like, other if other == "decode" else "prefill-full", label="other batch")
    backend.init_graph(other, capacity_for(other, [other_batch]))
    other_info = not_fallback(backend.prepare(other_batch, other), f"{other} batch")
    theirs = _storages(other_info)
    for a, (lo, hi) in mine.items():
        for b, (lo2, hi2) in theirs.items():
            if lo < hi2 and lo2 < hi:
                raise AssertionError(f"{family}.{a} and {other}.{b} share storage | {case.describe()}")
    for n, t in metadata_tensors(info).items():
        if not torch.equal(t, snapshot[n]):
            raise AssertionError(f"preparing a {other} batch changed {family}.{n} | {case.describe()}")
