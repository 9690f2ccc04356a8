"""SGLang's own attention test kit (``sglang.test.kits.attention_unittest``), keyed by
backend name, run with ``"hygon"``: ``make_dense_cases("hygon")`` builds SGLang's mock
model runner, ReqToTokenPool and MHATokenToKVPool, our backend through the registered
factory, a RadixAttention layer, and compares with the kit's dense reference at the kit's
own tolerance.

Runs on CPU (float16 through the Triton kernels under the interpreter, float32 through the
reference) and on a GPU (``device`` fixture: CUDA when present), for the token-major NHD
pool and the HND pool (``SGLANG_USE_HND_KVCACHE=1``).
"""

import pytest
import torch

pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.dense_attention")

from sglang.test.kits.attention_unittest.attention_methods import (  # noqa: E402
    dense_attention as kit,
)

from hygon_attn_backend.integrations.sglang import register  # noqa: E402
from hygon_attn_backend.ops.decode import DecodePlan  # noqa: E402
from hygon_attn_backend.ops.prefill import PrefillPlan  # noqa: E402
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend  # noqa: E402

CASES = kit.make_dense_cases("hygon")
DTYPES = (torch.float16, torch.float32)


class _KitTestCase:
    """The kit calls ``testcase.skipTest`` when a backend cannot be built: for us that is
    a failure, never a skip."""

    def skipTest(self, reason):  # noqa: N802 (unittest's name)
        pytest.fail(f"the kit could not build the hygon backend: {reason}")


@pytest.fixture
def no_grad():
    # the kit fills the pool through nn.Linear outputs; on CPU an in-place store of a
    # tensor that requires grad fails (notes/install.md)
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    yield
    torch.set_grad_enabled(previous)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the layer calls that ran each plan, by the implementation it resolved to
    (``run_layer``: what the backend calls per layer, and what ``run`` goes through)."""
    counts = {}
    for name, cls in (("decode", DecodePlan), ("prefill", PrefillPlan)):
        real = cls.run_layer

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[(_name, self.impl)] = counts.get((_name, self.impl), 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run_layer", counted)
    return counts


def _run_case(case, dtype, device, loc_layout="shuffled_pages"):
    fixture = kit.build_dense_attention_fixture(_KitTestCase(), case, dtype=dtype,
                                                device=str(device), loc_layout=loc_layout)
    assert isinstance(fixture.backend, HygonAttnBackend)
    actual = kit.run_dense_fixture_eager(fixture)
    expected = kit.expected_dense_fixture_output(fixture)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=kit.DENSE_ATOL, rtol=kit.DENSE_RTOL)
    return fixture


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_dense_case(case, dtype, layout, device, no_grad, op_calls, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1" if layout == "hnd" else "0")
    register()
    fixture = _run_case(case, dtype, device)
    assert fixture.runner.token_to_kv_pool.kv_cache_layout == layout
    op = "decode" if case.forward_mode.is_decode() else "prefill"
    want = "triton" if fixture.backend._triton_here and dtype != torch.float32 else "reference"
    assert op_calls.get((op, want), 0) > 0, f"the {op} plan was expected to run {want}: " \
        f"{op_calls}"


@pytest.mark.parametrize("loc_layout", ["interleaved_pages", "non_monotonic_extend"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_dense_case_scattered_slots(case, loc_layout, device, no_grad, monkeypatch):
    """The kit's non-tidy slot layouts (pages of different requests interleaved, extend
    tokens scattered) in float16."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "0")
    register()
    _run_case(case, torch.float16, device, loc_layout=loc_layout)
