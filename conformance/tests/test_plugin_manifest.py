"""Expected-failure manifests: parsing, matching, xfail(strict) and the warning for stale entries.

Covers: a manifest is validated before anything runs (unknown property, mode, dtype or key, a
missing reason, bad TOML → a clear error; through the plugin, a usage error); entries match by
property and optional mode / dtype; matching items become strict xfails — a known failure is
reported "xfailed", a manifest entry for an item that passes fails the run — and an entry that
matches no collected item is warned about and listed in the JSON report.
"""

import pytest

from moelora_conformance.faulty import target
from moelora_conformance.manifest import load_manifest
from moelora_conformance.properties.registry import PROPERTIES
from moelora_conformance.session import run_suite
from moelora_core import InvalidFieldError

KNOWN = set(PROPERTIES)


def write(tmp_path, text):
    p = tmp_path / "manifest.toml"
    p.write_text(text)
    return p


def test_entries_match_by_property_mode_and_dtype(tmp_path):
    m = load_manifest(write(tmp_path, """
[[expected_failure]]
property = "P05"
mode = "decode"
reason = "segment count frozen at capture"

[[expected_failure]]
property = "P01"
dtype = "fp16"
reason = "fp16 accumulation"
"""), KNOWN)
    assert m.match("P05", "decode", "fp32").reason == "segment count frozen at capture"
    assert m.match("P05", "prefill-full", "fp32") is None
    assert m.match("P01", "eager", "fp16").index == 1
    assert m.match("P01", "eager", "fp32") is None
    assert load_manifest(None, KNOWN).entries == ()


@pytest.mark.parametrize(("text", "problem"), [
    ('[[expected_failure]]\nproperty = "P99"\nreason = "x"\n', "unknown property"),
    ('[[expected_failure]]\nproperty = "P01"\nmode = "warp"\nreason = "x"\n', "unknown mode"),
    ('[[expected_failure]]\nproperty = "P01"\ndtype = "fp8"\nreason = "x"\n', "unknown dtype"),
    ('[[expected_failure]]\nproperty = "P01"\n', "non-empty reason"),
    ('[[expected_failure]]\nproperty = "P01"\nreason = "x"\nowner = "me"\n', "unknown keys"),
    ('[expected]\nproperty = "P01"\n', "unknown tables"),
    ('[[expected_failure]\n', "cannot read"),
])
def test_malformed_manifests_are_refused(tmp_path, text, problem):
    with pytest.raises(InvalidFieldError, match=problem):
        load_manifest(write(tmp_path, text), KNOWN)


def test_the_plugin_refuses_a_malformed_manifest(tmp_path):
    bad = write(tmp_path, '[[expected_failure]]\nproperty = "P99"\nreason = "x"\n')
    run = run_suite("reference", profile="interpret", manifest=bad, extra=["--co"])
    assert run.returncode == 4 and "unknown property" in run.output, run.output[-2000:]


@pytest.mark.slow
def test_known_failures_xfail_and_stale_entries_warn(tmp_path):
    manifest = write(tmp_path, """
[[expected_failure]]
property = "P01"
mode = "decode"
reason = "this mutant syncs with the host in the down delta"

[[expected_failure]]
property = "P06"
mode = "eager"
reason = "P06 has no eager mode: matches nothing"
""")
    run = run_suite(target("host-sync"), profile="interpret", manifest=manifest, max_examples=2,
                    extra=["-k", "test_every_output_row_equals_the_oracle and decode"])
    assert run.returncode == 0, run.output[-4000:]
    assert {r["outcome"] for r in run.report["records"]} == {"xfailed"}
    assert all("host" in r["reason"] for r in run.report["records"])
    assert run.report["manifest_unmatched"] == ["expected_failure[1] (property=P06 mode=eager dtype=*)"]
    assert "matched no test" in run.output
    # strict expected failures need a reproducible search: a manifest derandomizes it
    assert run.report["derandomize"] is True


@pytest.mark.slow
def test_a_manifest_entry_for_a_passing_item_fails_the_run(tmp_path):
    manifest = write(tmp_path, '[[expected_failure]]\nproperty = "P07"\nmode = "eager"\ndtype = "fp32"\n'
                               'reason = "stale: this passes"\n')
    run = run_suite("reference", profile="interpret", manifest=manifest, max_examples=2,
                    extra=["-k", "test_metadata_is_exact and eager-fp32"])
    assert run.returncode == 1, run.output[-4000:]
    (rec,) = run.report["records"]
    assert rec["outcome"] == "xpassed" and "XPASS(strict)" in run.output  # a stale entry: fails the run
    assert run.report["derandomize"] is True


def test_an_explicit_seed_keeps_the_search_random_with_a_manifest(tmp_path):
    manifest = write(tmp_path, '[[expected_failure]]\nproperty = "P07"\nreason = "x"\n')
    run = run_suite("reference", profile="interpret", manifest=manifest, max_examples=1,
                    extra=["-k", "test_metadata_is_exact and eager-fp32", "--hypothesis-seed=3"])
    assert run.report["derandomize"] is False, run.output[-2000:]
