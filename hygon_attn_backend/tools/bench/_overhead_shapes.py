"""The problems ``bench overhead`` times (tiny, so the host cost is what is measured)."""

DECODE = dict(num_seqs=32, ctx=512)           # B=32, ctx 512
EXTEND = dict(num_seqs=4, prefix=256, new=64)  # B=4, prefix 256, 64 new tokens
MIXED = dict(num_decodes=16, ctx=512, num_extends=4, prefix=256, new=64)
