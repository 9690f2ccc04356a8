"""Runtime patch: SGLang 0.5's EAGLE v2 draft worker captures ``hygon``'s draft extend in a
CUDA graph.

``EagleDraftWorker._capture_cuda_graphs`` (``sglang/srt/speculative/eagle_worker_v2.py``)
captures the draft decode for any backend, but the draft extend (the draft model's pass
over the accepted tokens, once per step) only for a literal allow-list of backend classes
(``graph_supported_backend_types``, local to the method); with ``hygon`` it ran eagerly.
:func:`install` wraps the method: after SGLang's own, when it captured no draft-extend
graph, the draft-extend backend is ours, the platform is SGLang's own CUDA one, decode
graphs are on and ``SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH`` is unset, it builds SGLang's
``EAGLEDraftExtendCudaGraphRunner`` for the worker, as the method does for the listed
backends (our backend has the hooks that runner calls: ``init_cuda_graph_state``, the
capture / replay metadata with ``spec_info``). Every other backend sees SGLang's code
alone. Recorded in ``patches/sglang-0.5-eagle-v2-draft-extend-graph.md``.

Installed when SGLang's draft factory builds our draft-extend backend (the worker's module
is imported by then), so a process that never drafts on ``hygon`` is untouched. Gated to
:data:`PATCHED_VERSIONS` and to the names the wrapper reads; elsewhere nothing changes.
"""

from __future__ import annotations

import logging

from hygon_attn_backend.integrations._patch import unwrap_method, version_tuple, wrap_method

logger = logging.getLogger(__name__)

#: SGLang (major, minor) versions whose EAGLE v2 draft worker this patch was written for.
PATCHED_VERSIONS = ((0, 5),)
_MARK = "_hygon_attn_backend_draft_extend_graph"
#: the module names the wrapper reads (present in SGLang 0.5.17 and 0.5.23; 0.5.23 also
#: has ``current_platform``, whose out-of-tree platforms the wrapper leaves alone)
_NEEDED = ("EagleDraftWorker", "EAGLEDraftExtendCudaGraphRunner", "check_cuda_graph_backend",
           "Phase", "Backend", "envs")


def _captures_for_us(worker, module) -> bool:
    """Whether SGLang skipped a draft-extend capture it would have made for a listed
    backend, with ours in its place."""
    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    if getattr(worker, "cuda_graph_runner_for_draft_extend", None) is not None:
        return False
    if not isinstance(getattr(worker, "draft_extend_attn_backend", None), HygonAttnBackend):
        return False
    platform = getattr(module, "current_platform", None)  # none before 0.5.2x
    if not getattr(module, "_is_cuda", False) or \
            (platform is not None and platform.is_out_of_tree()):
        return False
    if module.check_cuda_graph_backend(module.Phase.DECODE, module.Backend.DISABLED):
        return False
    return not module.envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH.get()


def install(version) -> bool:
    """Wrap ``EagleDraftWorker._capture_cuda_graphs`` (idempotent). ``version``: the
    installed SGLang's version string. Returns True when the wrapper is in place."""
    if version_tuple(version) not in PATCHED_VERSIONS:
        return False
    try:
        from sglang.srt.speculative import eagle_worker_v2 as module
    except ImportError as exc:
        logger.debug("hygon: SGLang's EAGLE v2 worker not found (%s)", exc)
        return False
    missing = [name for name in _NEEDED if not hasattr(module, name)]
    worker_cls = getattr(module, "EagleDraftWorker", None)
    original = worker_cls.__dict__.get("_capture_cuda_graphs") if worker_cls else None
    if missing or original is None:
        logger.warning("SGLang %s: the EAGLE v2 draft worker is not the code this patch "
                       "expects (missing %s); 'hygon''s draft extend runs eagerly.",
                       version, missing or ["EagleDraftWorker._capture_cuda_graphs"])
        return False
    if getattr(worker_cls, _MARK, False):
        return True

    def _capture_cuda_graphs(self):
        original(self)
        if _captures_for_us(self, module):
            self.cuda_graph_runner_for_draft_extend = \
                module.EAGLEDraftExtendCudaGraphRunner(self)
            logger.info("hygon: the EAGLE draft extend is captured in CUDA graphs")

    wrap_method(worker_cls, "_capture_cuda_graphs", _capture_cuda_graphs, _MARK)
    return True


def uninstall() -> bool:
    """Restore SGLang's method (tests use this). Returns True if it was patched."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    return unwrap_method(EagleDraftWorker, "_capture_cuda_graphs", _MARK)
