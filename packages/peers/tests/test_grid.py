"""The grid's records: layer and e2e cells of a path, their statuses, replay lines and CPU
substitutes, the manifests it looks for, and the matrix's unexpected section.

Covers: an e2e record keeps its ``rerun`` line as the replay; an xfailed cell is an expected
failure, an xpassed one a stale entry (red); a refused path gives one refused cell; substitutes
named "(eager)" touch eager cells only; the e2e manifest is ``<peer>-<version>-<path>.e2e.toml``;
every manifest on disk names a known path and suite; an unknown ``--path`` is refused.
"""

from __future__ import annotations

import pytest
from moelora_peers import grid

SPEC = grid.PeerPathSpec("sglang", "legacy", "moelora_peers.sglang:legacy")
INFO = {"version": "0.5.23", "cpu_substitutes": {"x (eager)": "y", "z": "w"}}


def _rec(prop: str, mode: str, outcome: str, **extra) -> dict:
    return {"property": prop, "mode": mode, "dtype": "fp32", "outcome": outcome, "message": f"{prop} says", **extra}


def test_e2e_cells_keep_their_rerun_line_and_statuses() -> None:
    report = {"records": [_rec("E01", "full", "failed", repro={"rerun": "moelora-conformance e2e --x"}),
                          _rec("E02", "eager", "xfailed"), _rec("E03", "full", "xpassed"),
                          _rec("E05", "eager", "partial")]}
    cells = grid.cells(SPEC, INFO, report, 1, 0, "e2e")
    assert [c["status"] for c in cells] == ["fail", "fail", "fail", "not_run"]
    assert cells[0]["replay"] == "moelora-conformance e2e --x" and cells[0]["suite"] == "e2e"
    assert cells[1]["expected"] and not cells[1]["stale"] and cells[2]["stale"]
    assert cells[0]["cpu_substitutes"] == {"z": "w"} and cells[1]["cpu_substitutes"] == INFO["cpu_substitutes"]
    text = grid.matrix(cells)
    assert "stale manifest entry" in text and "E01 full fp32: fail" in text


def test_a_refused_path_is_one_refused_cell() -> None:
    (cell,) = grid.cells(SPEC, {"refused": "ImportError: no sglang"}, None, 1, 0)
    assert cell["status"] == "refused" and cell["reason"] == "ImportError: no sglang"


def test_manifests_on_disk_name_known_paths_and_suites() -> None:
    assert grid.manifest_path("vllm", "0.34.0", "fused", "e2e").name == "vllm-0.34.0-fused.e2e.toml"
    known = {grid.manifest_path(p.peer, v, p.path, s).name for p in grid.PATHS for s in grid.SUITES
             for v in ("0.5.23", "0.34.0")}
    on_disk = {p.name for p in grid.MANIFESTS.glob("*.toml")}
    assert on_disk and on_disk <= known, sorted(on_disk - known)


def test_unknown_path_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        grid.main(["render", "--out", str(tmp_path), "--path", "sglang:nope"])
