"""What every runtime patch of an engine method takes (``patches/``): the engine's
(major, minor) version to gate on, a wrapper put in the method's place, marked on the
class, and taken away again."""

from __future__ import annotations


def version_tuple(text):
    """``"0.5.23"`` -> ``(0, 5)``; None when ``text`` has no numeric major and minor."""
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


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
