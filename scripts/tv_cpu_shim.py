"""Register torchvision's nms/qnms schemas before torchvision loads beside CPU torch.

The torchvision wheel SGLang pins is a CUDA build; its Python module looks the two
operators up at import and fails on a CPU torch. Their schemas are enough for SGLang
(which never calls them on this path). Beside a CUDA torch (PyPI's default build, where
an index serves no CPU one) the wheel's own extension loads and registers them: defining
them first would abort that load (a duplicate registration), so nothing is defined there.
"""
import torch

if torch.version.cuda is None:
    _lib = torch.library.Library("torchvision", "FRAGMENT")
    for _op in ("nms", "qnms"):
        try:
            _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # the real ops are already registered
