"""SGLang's EAGLE v2 draft worker captures ``hygon``'s draft extend in a CUDA graph
(``integrations/sglang/draft_graphs.py``; ``patches/sglang-0.5-eagle-v2-draft-extend-graph.md``).

CPU: the wrapper's decision on a stand-in worker, SGLang's own capture skipped (as on a
CPU) and its graph runner replaced by a recorder; the install through the draft factory.
The capture itself is SGLang's runner over our backend's graph hooks, which SGLang's
draft-extend CUDA-graph kit runs on a GPU (``test_sglang_spec.py``).
"""

from __future__ import annotations

import types
from importlib.metadata import version

import pytest

pytest.importorskip("sglang.srt.speculative.eagle_worker_v2")

from sglang.srt.speculative import eagle_worker_v2  # noqa: E402

if "_capture_cuda_graphs" not in vars(eagle_worker_v2.EagleDraftWorker):
    pytest.skip("this SGLang's EAGLE v2 draft worker captures in init_cuda_graphs (0.5.10); "
                "the patch is written for its _capture_cuda_graphs form (0.5.17 on)",
                allow_module_level=True)

from hygon_attn_backend.integrations.sglang import draft_graphs  # noqa: E402
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend  # noqa: E402
from hygon_attn_backend.integrations.sglang.mla import HygonMLABackend  # noqa: E402


class _Runner:
    """Stands in for ``EAGLEDraftExtendCudaGraphRunner``: records the worker it got."""

    def __init__(self, worker):
        self.worker = worker


@pytest.fixture
def patched(monkeypatch):
    """The wrapper installed on a CUDA platform with decode graphs on; SGLang's own
    captures return at once (its CPU early exit), its runner a recorder."""
    assert draft_graphs.install(version("sglang"))
    monkeypatch.setattr(eagle_worker_v2, "_is_cpu", True)
    monkeypatch.setattr(eagle_worker_v2, "_is_cuda", True)
    monkeypatch.setattr(eagle_worker_v2, "check_cuda_graph_backend", lambda *a: False)
    monkeypatch.setattr(eagle_worker_v2, "EAGLEDraftExtendCudaGraphRunner", _Runner)
    monkeypatch.delenv("SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", raising=False)
    yield eagle_worker_v2.EagleDraftWorker._capture_cuda_graphs


def _worker(backend):
    return types.SimpleNamespace(draft_extend_attn_backend=backend)


@pytest.mark.parametrize("cls", [HygonAttnBackend, HygonMLABackend])
def test_our_draft_extend_is_captured(patched, cls):
    worker = _worker(object.__new__(cls))
    patched(worker)
    runner = worker.cuda_graph_runner_for_draft_extend
    assert isinstance(runner, _Runner) and runner.worker is worker
    assert worker.cuda_graph_runner is None  # SGLang's own method ran first


def test_other_backends_keep_sglangs_choice(patched):
    worker = _worker(object())  # a backend SGLang did not list: it captured nothing
    patched(worker)
    assert worker.cuda_graph_runner_for_draft_extend is None


@pytest.mark.parametrize("change", ["graphs_off", "not_cuda", "env_off", "out_of_tree"])
def test_no_capture_where_sglang_would_not_capture(patched, monkeypatch, change):
    if change == "graphs_off":
        monkeypatch.setattr(eagle_worker_v2, "check_cuda_graph_backend", lambda *a: True)
    elif change == "not_cuda":
        monkeypatch.setattr(eagle_worker_v2, "_is_cuda", False)
    elif change == "env_off":
        monkeypatch.setenv("SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", "1")
    else:
        platform = types.SimpleNamespace(is_out_of_tree=lambda: True)
        # 0.5.17 has no out-of-tree platforms (no current_platform): the wrapper reads it
        # where it exists
        monkeypatch.setattr(eagle_worker_v2, "current_platform", platform, raising=False)
    worker = _worker(object.__new__(HygonAttnBackend))
    patched(worker)
    assert worker.cuda_graph_runner_for_draft_extend is None


def test_install_is_gated_idempotent_and_reversible():
    cls = eagle_worker_v2.EagleDraftWorker
    draft_graphs.uninstall()
    original = cls._capture_cuda_graphs
    assert not draft_graphs.install("0.4.9") and cls._capture_cuda_graphs is original
    assert draft_graphs.install(version("sglang"))
    wrapped = cls._capture_cuda_graphs
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert draft_graphs.install(version("sglang")) and cls._capture_cuda_graphs is wrapped
    assert draft_graphs.uninstall() and cls._capture_cuda_graphs is original
    assert not draft_graphs.uninstall()


def test_a_changed_worker_is_left_alone(monkeypatch):
    draft_graphs.uninstall()
    monkeypatch.delattr(eagle_worker_v2, "EAGLEDraftExtendCudaGraphRunner")
    original = eagle_worker_v2.EagleDraftWorker._capture_cuda_graphs
    assert not draft_graphs.install(version("sglang"))
    assert eagle_worker_v2.EagleDraftWorker._capture_cuda_graphs is original
