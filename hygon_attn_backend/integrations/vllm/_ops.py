"""The kernel entry points the vLLM backend calls, behind one indirection.

Each of the three functions is the package's public op when its module exists
(``hygon_attn_backend.ops.decode`` / ``.prefill`` / ``.cache``), called with
``impl=<chosen>``; while a module is absent the plain-torch reference of the same name
stands in (same arguments, no ``impl``). Switching a call is one line in :data:`_PUBLIC`.

The implementation the public ops run is ``HYGON_ATTN_IMPL`` (``auto`` | ``triton`` |
``reference``; default ``auto``: Triton on a GPU or under ``TRITON_INTERPRET=1``, the
reference otherwise), read once per attention layer when vLLM builds it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, NamedTuple, Optional

from hygon_attn_backend.ops._dispatch import IMPL_ENV, IMPLS, impl_from_env  # noqa: F401

# name -> (public module, function name)
_PUBLIC = {
    "decode": ("hygon_attn_backend.ops.decode", "paged_decode_attention"),
    "prefill": ("hygon_attn_backend.ops.prefill", "prefix_prefill_attention"),
    "write_kv": ("hygon_attn_backend.ops.cache", "write_kv"),
}


class Op(NamedTuple):
    fn: Callable
    public: bool  # True: takes impl=...; False: the reference, which does not




@functools.lru_cache(maxsize=None)
def resolve(name: str) -> Op:
    """The function behind ``name`` ('decode', 'prefill' or 'write_kv')."""
    module_name, attr = _PUBLIC[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the op exists but something it needs is missing: say so
        from hygon_attn_backend import reference

        return Op(getattr(reference, attr), public=False)
    return Op(getattr(module, attr), public=True)


def call(name: str, *args, impl: str = "auto", op_options: Optional[dict] = None, **kwargs):
    """Call op ``name``. ``op_options`` are options only the public ops take (a decode
    workspace, a prefill plan, ...); they are dropped when the reference stands in."""
    op = resolve(name)
    if op.public:
        kwargs["impl"] = impl
        kwargs.update(op_options or {})
    return op.fn(*args, **kwargs)


def runs_triton(impl: str, device) -> bool:
    """True when the public ops exist and ``impl`` resolves to Triton on ``device``."""
    if not (resolve("decode").public and resolve("prefill").public):
        return False
    from hygon_attn_backend.ops._dispatch import select_impl

    return select_impl(impl, device) == "triton"
