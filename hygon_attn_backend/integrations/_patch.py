"""The two steps every runtime patch of an engine method takes (``patches/``): put a
wrapper in the method's place, marked on the class, and take it away again."""

from __future__ import annotations


def wrap_method(cls, name: str, wrapper, mark: str) -> None:
    """Put ``wrapper`` on ``cls`` as ``name`` in place of the function ``cls`` defines
    there (kept as ``wrapper.__wrapped__``, its docstring copied) and set the class
    attribute ``mark``. The caller checks ``mark`` first (idempotence)."""
    original = cls.__dict__[name]
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(cls, name, wrapper)
    setattr(cls, mark, True)


def unwrap_method(cls, name: str, mark: str) -> bool:
    """Undo :func:`wrap_method`; False (nothing changed) when ``mark`` is not set."""
    if not getattr(cls, mark, False):
        return False
    setattr(cls, name, cls.__dict__[name].__wrapped__)
    delattr(cls, mark)
    return True
