"""P08 on the CPU judges host-to-device traffic as CUDA would.

Covers: a backend that builds its metadata the way production backends do — host tensors made with
``device="cpu"`` (pinned where CUDA is), then ``.to(device, non_blocking=True)`` — passes P08 on the
CPU (on CUDA that is an asynchronous copy); the same metadata made with ``device=<the device>`` and
read with no copy (a blocking host-to-device copy on CUDA) still fails it, as does a blocking
``.to(device)``.
"""

import os
from pathlib import Path

import pytest
import torch

from moelora_conformance.session import run_suite
from moelora_reference.backend import ReferenceBackend

HERE = Path(__file__).resolve().parent
I32 = torch.int32


class HostListsBackend(ReferenceBackend):
    """The reference whose eager metadata is built from host lists in one of three ways (``how``)."""

    name = "host-lists"
    how = "idiom"

    def prepare(self, batch, family=None, bucket=None):
        info = super().prepare(batch, family, bucket)
        if family is not None:
            return info
        dev, values = self.spec.device, list(batch.token_lora_mapping)
        if self.how == "idiom":  # host tensor, then an asynchronous copy
            pinned = torch.cuda.is_available()
            t = torch.tensor(values, dtype=I32, device="cpu", pin_memory=pinned).to(dev, non_blocking=True)
        elif self.how == "blocking-to":
            t = torch.tensor(values, dtype=I32, device="cpu").to(dev)
        else:  # "direct": torch.tensor(..., device=dev), read by the deltas (a blocking copy on CUDA)
            t = torch.tensor(values, dtype=I32, device=dev)
        info.token_lora_mapping = t
        return info


def make_idiom(spec):
    return HostListsBackend(spec)


def make_blocking_to(spec):
    b = HostListsBackend(spec)
    b.how = "blocking-to"
    return b


def make_direct(spec):
    b = HostListsBackend(spec)
    b.how = "direct"
    return b


def _run(factory):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return run_suite(f"test_suite_host_sync:{factory}", profile="interpret", env=env, max_examples=4,
                     no_shrink=True, extra=["-k", "test_no_host_sync_in_prepare_and_forward and eager"])


@pytest.mark.slow
def test_host_tensors_copied_non_blocking_pass_p08_and_blocking_reads_fail():
    ok = _run("make_idiom")
    assert ok.returncode == 0, ok.output[-3000:]
    assert {r["outcome"] for r in ok.report["records"]} == {"passed"}
    for factory, what in (("make_blocking_to", "blocking"), ("make_direct", "host tensor")):
        bad = _run(factory)
        assert bad.returncode == 1, bad.output[-3000:]
        failed = [r for r in bad.report["records"] if r["outcome"] == "failed"]
        assert failed and all(r["message"].startswith("HostSyncError") for r in failed), failed
        assert what in failed[0]["message"], failed[0]["message"]
