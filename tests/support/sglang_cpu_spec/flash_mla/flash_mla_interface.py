"""Test-only stand-in (see the package): the names SGLang imports from here."""


class FlashMLASchedMeta:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("flash_mla stand-in: FlashMLASchedMeta is not available")


def __getattr__(name):
    from flash_mla import _missing

    return _missing(name)
