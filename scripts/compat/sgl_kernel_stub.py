"""An import-only stand-in for ``sgl_kernel`` in the CPU check environment of SGLang
versions that import it at module level (0.5.10: ``mem_cache/memory_pool_host.py``, reached
from ``radix_cache``, the scheduler and the engine; 0.5.17 with ``SGLANG_USE_CPU_ENGINE=1``:
``kernels/ops/kvcache/cache_move.py``).

The only ``sgl_kernel`` on the package registry is the CUDA build (it needs libnvrtc), and
SGLang's CPU build of it is compiled from source, so a CPU machine has none. This finder
serves ``sgl_kernel`` and its submodules only when no real one is importable: every name
resolves to a placeholder, and calling one raises ``RuntimeError`` naming it, so a check
that reaches a kernel fails loudly instead of passing on a stand-in. Installed by
``sglang_checks.build_env`` through a ``.pth`` file, never into a user's environment.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_ROOT = "sgl_kernel"


class _Missing:
    """A name of the absent ``sgl_kernel``: attributes are placeholders too; a call raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: sgl_kernel is not installed (CPU check environment: "
                           "import-only stand-in)")

    def __repr__(self):
        return f"<missing {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        # appended last to sys.meta_path: reached only when no real sgl_kernel was found;
        # submodules are served only under this stand-in
        root = sys.modules.get(_ROOT)
        if fullname != _ROOT and not isinstance(root, _StubModule):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
