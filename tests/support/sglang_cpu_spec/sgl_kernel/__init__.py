"""Test-only: the ``sgl_kernel`` package of ``tests/support/sglang_cpu_spec`` (see its
``sitecustomize``). It holds only ``speculative.reconstruct_indices_from_tree_mask``; any
other name is an ImportError, as without the package."""

__version__ = "0.0.0+cpu-test"
