"""``hygon-attn demo``: the engine run (``engine.py``) and the ops check (``ops.py``)."""
