"""Test-only stand-in for the ``sgl-flash-mla`` wheel (not on the package registry here).
On CUDA, SGLang's EAGLE worker imports its FlashMLA backend to list the backends whose
draft extend it captures in a CUDA graph, which imports this package at load time; no
backend compared in these runs calls FlashMLA. Every name is a placeholder that raises
when called."""


def _missing(name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"flash_mla stand-in: {name} is not available")
    call.__name__ = name
    return call


fused_norm_rope_attn_rope_cast = _missing("fused_norm_rope_attn_rope_cast")


def __getattr__(name):
    return _missing(name)
