"""Register torchvision's nms/qnms schemas before torchvision loads beside CPU torch.

The torchvision wheel SGLang pins is a CUDA build; its Python module looks the two
operators up at import and fails on a CPU torch. Their schemas are enough for SGLang
(which never calls them on this path).
"""
import torch

_lib = torch.library.Library("torchvision", "FRAGMENT")
for _op in ("nms", "qnms"):
    try:
        _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        pass  # the real ops are already registered
