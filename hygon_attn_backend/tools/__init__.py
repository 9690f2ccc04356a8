"""The tools wing: the ``hygon-attn`` CLI, benchmarks, fuzz, simulate, demo and doctor.
Never imported by the engine path (``ops/``, ``integrations/``)."""
