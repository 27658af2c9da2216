"""The tolerance policy, LoRALayerSpec / Capabilities validation, and backend loading."""

import sys

import pytest
import torch

from moelora_core import (
    DEFAULT_POLICY,
    Capabilities,
    InvalidFieldError,
    LoRALayerSpec,
    assert_exact,
    load_backend,
)


def test_policy_defaults_match_design():
    p = DEFAULT_POLICY
    assert (p.lookup(torch.float32).max_rel, p.lookup(torch.float32).rms_rel) == (1e-5, 1e-5)
    assert p.lookup(torch.float32, tf32=True).max_rel == 2e-3
    assert (p.lookup(torch.float16).max_rel, p.lookup(torch.float16).rms_rel) == (2e-3, 1e-3)
    assert (p.lookup(torch.bfloat16, "cuda").max_rel, p.lookup(torch.bfloat16, "cuda").rms_rel) == (2e-2, 8e-3)


def test_norm_check_passes_rounding_and_fails_real_error():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    DEFAULT_POLICY.assert_close(ref.half(), ref, dtype=torch.float16)
    bad = ref.clone()
    bad[3, 7] += 0.1 * ref.abs().max()
    with pytest.raises(AssertionError, match=r"1 elements off(.|\n)*at \(3, 7\)"):
        DEFAULT_POLICY.assert_close(bad.half(), ref, dtype=torch.float16, seed=11)


def test_nan_always_fails_and_reports_seed():
    ref = torch.randn(4, 4, dtype=torch.float64)
    out = ref.clone()
    out[0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"1 non-finite(.|\n)*seed=5"):
        DEFAULT_POLICY.assert_close(out, ref, dtype=torch.float32, seed=5)


def test_assert_exact_reports_coordinates():
    a = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    assert_exact(a, a.clone(), what="expert_ids")
    b = a.clone()
    b[1, 0] = -1
    with pytest.raises(AssertionError, match=r"expert_ids: 1 of 4 elements differ \(seed=3\)(.|\n)*\(1, 0\): expected -1, actual 2"):
        assert_exact(a, b, what="expert_ids", seed=3)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"top_k": 9}, "top_k"),
        ({"dense_shapes": {"gate": (4, 4)}}, "dense_shapes['gate']"),
        ({"dense_shapes": {"q": (4,)}}, "dense_shapes['q']"),
        ({"dtype": torch.int8}, "dtype"),
        # adversarial inputs: raw TypeError / RuntimeError before
        ({"dense_shapes": None}, "dense_shapes"),
        ({"device": "bogus"}, "device"),
    ],
)
def test_layer_spec_validation(kw, field):
    base = {"hidden_size": 16, "moe_intermediate_size": 8, "num_experts": 4, "top_k": 2,
            "dense_shapes": {"q": (16, 16)}, "max_loras": 2, "max_rank": 4}
    base.update(kw)
    with pytest.raises(InvalidFieldError) as exc:
        LoRALayerSpec(**base)
    assert exc.value.field == field


def test_capabilities_validation():
    with pytest.raises(InvalidFieldError, match="graph_families"):
        Capabilities(dtypes={torch.float32}, graph_families={"decoder"})
    with pytest.raises(InvalidFieldError, match="without the 'prefill'"):
        Capabilities(dtypes={torch.float32}, graph_families={"decode"}, prefill_graph_modes={"full"})
    caps = Capabilities(dtypes={torch.float16, torch.float32}, graph_families={"decode"})
    assert caps.as_dict()["dtypes"] == ["float16", "float32"]


def test_load_backend_errors_name_the_target():
    with pytest.raises(InvalidFieldError, match="expected 'module:factory'"):
        load_backend("no-colon")
    with pytest.raises(InvalidFieldError, match="cannot import 'not_a_module_xyz'"):
        load_backend("not_a_module_xyz:make")
    with pytest.raises(InvalidFieldError, match="no callable 'nope'"):
        load_backend("moelora_core:nope")
    assert load_backend("moelora_core.batch:BatchSpec") is not None


def test_load_backend_finds_a_module_in_the_current_directory(tmp_path, monkeypatch):
    # a user's backend file beside them, without PYTHONPATH=. (as `python -m pytest` finds it)
    (tmp_path / "my_cwd_backend_mod.py").write_text("def make(spec):\n    return ('made', spec)\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_backend_mod", raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_backend("my_cwd_backend_mod:make")(1) == ("made", 1)
    # a missing module is still a named error, and an import error inside the module is not masked
    with pytest.raises(InvalidFieldError, match="cannot import 'absent_cwd_mod'"):
        load_backend("absent_cwd_mod:make")
    (tmp_path / "broken_cwd_backend_mod.py").write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(InvalidFieldError, match="not_installed_dependency_xyz"):
        load_backend("broken_cwd_backend_mod:make")
