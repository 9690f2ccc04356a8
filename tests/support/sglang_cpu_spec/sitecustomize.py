"""Test-only: lets SGLang 0.5.23's speculative workers run on a CPU (generic device path,
kernels in Triton's interpreter), for ``tests/integrations/sglang/test_sglang_spec_engine.py``,
which alone puts this folder on ``PYTHONPATH`` (the engine's scheduler processes import
this module at start-up).

SGLang's speculative helpers that are not attention (draft-tree construction, greedy tree
verify, draft cache-location assignment) pick their implementation by platform: CUDA / HIP
take JIT-compiled CUDA, XPU SGLang's own Triton kernels, its CPU engine ``sgl_kernel``'s CPU
build (not on the package registry), and the generic CPU path none (the helpers return
nothing). After those modules load, this marks them as on XPU (and not on CUDA / HIP), so
each call takes SGLang's Triton form of the op, with the XPU branch's arguments. The same
folder serves the GPU engine run (``docs/reliability.md``), after the GPU stand-in
``sgl_kernel`` on ``PYTHONPATH``: there it keeps the helpers off SGLang's JIT-compiled CUDA
(a CUDA toolchain at run time), so every backend compared runs the same Triton helpers. The
attention backend under test is not touched. ``sgl_kernel/speculative.py`` beside this
answers the one import that the reconstruct-tree module makes at load time on a non-XPU
platform; ``flash_mla/`` the import of FlashMLA that SGLang's EAGLE worker makes on CUDA
(a GPU run), never called.
"""

import importlib.abc
import sys

_XPU_MODULES = ("sglang.kernels.ops.speculative.spec_tree",
                "sglang.kernels.ops.speculative.cache_locs",
                "sglang.kernels.ops.speculative.reconstruct_tree")


class _MarkXpu(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _XPU_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                real_exec = spec.loader.exec_module

                def exec_module(module, _real=real_exec):
                    _real(module)
                    module._is_xpu = True
                    for flag in ("_is_cuda", "_is_hip"):
                        if hasattr(module, flag):
                            setattr(module, flag, False)

                spec.loader.exec_module = exec_module
                return spec
        return None


sys.meta_path.insert(0, _MarkXpu())
