"""Test configuration shared by every test module.

On a machine without a CUDA device the Triton kernels run in Triton's CPU interpreter:
``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` function is defined, so it
is set here, before the package's kernels are imported by any test module.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_SKIP_REASON = "needs a CUDA GPU (run on the H200 test machine: see README 'GPU tests')"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
