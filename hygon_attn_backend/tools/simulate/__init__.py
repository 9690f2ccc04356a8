"""``hygon-attn simulate``: replay a request trace through the engines' own KV memory
managers (vLLM's ``KVCacheManager``, SGLang's ``RadixCache`` and allocators) and a
contiguous per-request baseline, on the CPU, without a model; report memory reserved
versus used, prefix reuse, and how many requests fit in a given memory.

traces.py (workloads), managers.py (the managers behind one interface), engine.py (the
serving loop and its accounting), cli.py (command line, table, CSV, plot).
"""
