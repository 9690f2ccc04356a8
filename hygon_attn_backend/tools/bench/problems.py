"""The benchmark problems (one paged cache shared by every implementation) and the check
of an output against :mod:`hygon_attn_backend.reference` before anything is timed.

The caches are stored ``[num_blocks, P, Hkv, D]`` (vLLM's flash layout, SGLang's token
pool seen in pages, FlashInfer's NHD), filled with random values, and every request's
block table is a slice of a random permutation of the blocks, as a long-running server's
free list hands them out. An fp8 problem (``kv_dtype`` e4m3fn / e5m2) quantizes the same
random caches with one per-tensor scale each, ``amax / the format's largest value``
(:func:`quantize_caches`), or with one such scale per KV head (``*_per_head`` names); every
implementation gets those scales (a peer that takes per-tensor scales only says so).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the ``--kv-dtype`` names of the benchmarks: ``auto`` is the query's own dtype; an fp8
#: name ending ``_per_head`` scales each KV head by its own amax (``[Hkv]`` fp32 scales)
KV_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
             "fp8_e4m3_per_head": "float8_e4m3fn", "fp8_e5m2_per_head": "float8_e5m2"}

# error budget: max|out - ref32| <= MULT * max|ref_lowp - ref32| + FLOOR[dtype], where
# ref_lowp is the same reference computed in the input dtype (tests/support/budget.py's rule)
BUDGET_MULT = 4.0
BUDGET_FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2}
CHECK_SEQS = 4  # decode: sequences checked against the reference
CHECK_ROWS = 128  # prefill: last query rows of the first request checked


class _Paged:
    """What both problems share: the shapes and the paged caches' views."""

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_store.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def kv_dtype(self):
        return self.k_store.dtype

    @property
    def fp8(self) -> bool:
        return self.k_store.element_size() == 1

    def scales(self) -> dict:
        """``k_scale`` / ``v_scale`` keywords of an fp8 problem's calls ({} otherwise)."""
        return dict(k_scale=self.k_scale, v_scale=self.v_scale) if self.fp8 else {}

    @property
    def per_head_scales(self) -> bool:
        """Whether the fp8 scales are ``[Hkv]`` tensors (else floats)."""
        return not isinstance(self.k_scale, float)

    def kv_views(self):
        """The caches as the canonical ``[num_blocks, Hkv, P, D]`` views."""
        return self.k_store.permute(0, 2, 1, 3), self.v_store.permute(0, 2, 1, 3)

    def slots(self, start: int, stop: int):
        """``[B, stop - start]`` int64 slot (``block * P + offset``) of key positions
        ``start .. stop - 1`` of every request."""
        import torch
        pos = torch.arange(start, stop, device=self.q.device)
        blocks = self.block_table.to(torch.int64)[:, pos // self.page_size]
        return blocks * self.page_size + pos % self.page_size


@dataclass
class DecodeProblem(_Paged):
    """q: ``[B, Hq, D]``; k_store, v_store: ``[num_blocks, P, Hkv, D]`` (q's dtype or fp8
    with ``k_scale`` / ``v_scale``: floats, or ``[Hkv]`` fp32 tensors per head);
    block_table: ``[B, ceil(ctx / P)]`` int32 (a random permutation of the blocks);
    seq_lens: ``[B]`` int32, all ``ctx``."""

    q: object
    k_store: object
    v_store: object
    block_table: object
    seq_lens: object
    ctx: int
    page_size: int
    scale: float
    k_scale: float = 1.0
    v_scale: float = 1.0

    def token_slots(self):
        """``[B, ctx]`` int64 slot of every key."""
        return self.slots(0, self.ctx)

    def kv_bytes(self) -> int:
        """Bytes of K and V one call must read."""
        return (2 * self.batch * self.ctx * self.num_kv_heads * self.head_dim
                * self.k_store.element_size())


@dataclass
class PrefillProblem(_Paged):
    """q: ``[B * extend, Hq, D]``; k_new, v_new: ``[B * extend, Hkv, D]`` (the new tokens'
    K/V, also stored in the cache); k_store, v_store: ``[num_blocks, P, Hkv, D]`` holding
    every request's ``prefix + extend`` keys; block_table: ``[B, ceil((prefix + extend) /
    P)]`` int32; cu_seqlens_q: ``[B + 1]`` int32; seq_lens_k: ``[B]`` int32."""

    q: object
    k_new: object
    v_new: object
    k_store: object
    v_store: object
    block_table: object
    cu_seqlens_q: object
    seq_lens_k: object
    prefix: int
    extend: int
    page_size: int
    scale: float
    k_scale: float = 1.0
    v_scale: float = 1.0

    def token_slots(self, start: int, stop: int):
        """``[B, stop - start]`` int64 slots of key positions ``start..stop-1``."""
        return self.slots(start, stop)

    def flops(self) -> float:
        """Unmasked FLOPs (QK^T and PV, 2 per multiply-add) of the causal batch."""
        pairs = self.extend * self.prefix + self.extend * (self.extend + 1) / 2
        return 4.0 * self.head_dim * self.num_q_heads * pairs * self.batch


def _paged_cache(num_blocks, page, hkv, dim, dtype, device, gen):
    import torch
    shape = (num_blocks, page, hkv, dim)
    k = torch.randn(shape, device=device, generator=gen).to(dtype)
    v = torch.randn(shape, device=device, generator=gen).to(dtype)
    return k, v


def kv_dtype_of(name):
    """The torch dtype of a ``--kv-dtype`` name (None: ``auto``, the query's dtype)."""
    import torch
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return None if KV_DTYPES[name] is None else getattr(torch, KV_DTYPES[name])


def quantize_caches(k, v, kv_dtype, *, per_head: bool = False):
    """``(k8, v8, k_scale, v_scale)``: ``k``/``v`` (``[num_blocks, P, Hkv, D]``) in
    ``kv_dtype`` (fp8) with one scale each, ``amax / finfo(kv_dtype).max`` (a zero cache
    takes scale 1); ``per_head``: the scales are ``[Hkv]`` fp32 tensors, each head's own."""
    import torch
    from hygon_attn_backend import reference
    fmax = torch.finfo(kv_dtype).max
    out = []
    for x in (k, v):
        if per_head:
            amax = x.float().abs().amax(dim=(0, 1, 3)) if x.numel() else \
                torch.zeros(x.shape[2], device=x.device)
            out.append(torch.where(amax > 0, amax / fmax, torch.ones_like(amax)))
        else:
            amax = float(x.float().abs().amax()) if x.numel() else 0.0
            out.append((amax / fmax) if amax > 0 else 1.0)
    return (reference.quantize_fp8(k, kv_dtype, out[0]),
            reference.quantize_fp8(v, kv_dtype, out[1]), out[0], out[1])


def per_head_name(name: str) -> bool:
    """Whether a ``--kv-dtype`` name asks for per-KV-head scales."""
    return name.endswith("_per_head")


def _head_scale(scale):
    """A scale that broadcasts over ``[..., Hkv, D]``: a float, or ``[Hkv, 1]``."""
    return scale if isinstance(scale, float) else scale.view(-1, 1)


def build_decode(*, batch, ctx, page_size, num_q_heads, num_kv_heads, head_dim, dtype,
                 device, seed=0, kv_dtype=None, per_head=False) -> DecodeProblem:
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per = -(-ctx // page_size)
    nb = batch * blocks_per
    k, v = _paged_cache(nb, page_size, num_kv_heads, head_dim, dtype, device, gen)
    perm = torch.randperm(nb, device=device, generator=gen)
    table = perm.reshape(batch, blocks_per).to(torch.int32)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, num_q_heads, head_dim, device=device, generator=gen).to(dtype)
    scales = ()
    if kv_dtype is not None and kv_dtype != dtype:
        k, v, *scales = quantize_caches(k, v, kv_dtype, per_head=per_head)
    return DecodeProblem(q, k, v, table, lens, ctx, page_size, head_dim ** -0.5, *scales)


def build_prefill(*, batch, prefix, extend, page_size, num_q_heads, num_kv_heads, head_dim,
                  dtype, device, seed=0, kv_dtype=None, per_head=False) -> PrefillProblem:
    """The new tokens' dense ``k_new``/``v_new`` are the cache's rows (dequantized to q's
    dtype for an fp8 cache): both K/V sources give the same answer."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    len_k = prefix + extend
    blocks_per = -(-len_k // page_size)
    nb = batch * blocks_per
    k, v = _paged_cache(nb, page_size, num_kv_heads, head_dim, dtype, device, gen)
    scales = ()
    if kv_dtype is not None and kv_dtype != dtype:
        k, v, *scales = quantize_caches(k, v, kv_dtype, per_head=per_head)
    perm = torch.randperm(nb, device=device, generator=gen)
    table = perm.reshape(batch, blocks_per).to(torch.int32)
    q = torch.randn(batch * extend, num_q_heads, head_dim, device=device,
                    generator=gen).to(dtype)
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * extend
    lens_k = torch.full((batch,), len_k, device=device, dtype=torch.int32)
    prob = PrefillProblem(q, None, None, k, v, table, cu, lens_k, prefix, extend, page_size,
                          head_dim ** -0.5, *scales)
    slots = prob.token_slots(prefix, len_k).reshape(-1)  # the new tokens, request-major
    prob.k_new = (k.view(-1, num_kv_heads, head_dim)[slots].float()
                  * _head_scale(prob.k_scale)).to(dtype)
    prob.v_new = (v.view(-1, num_kv_heads, head_dim)[slots].float()
                  * _head_scale(prob.v_scale)).to(dtype)
    return prob


def _budget(out, ref32, ref_lowp, dtype_name):
    err = (out.float() - ref32).abs().max().item()
    ref_err = (ref_lowp.float() - ref32).abs().max().item()
    budget = BUDGET_MULT * ref_err + BUDGET_FLOOR.get(dtype_name, 2e-3)
    finite = bool(out.float().isfinite().all())
    return finite and err <= budget, err, budget


def check_decode(prob: DecodeProblem, out) -> tuple:
    """``(ok, max error, budget)`` of ``out [B, Hq, D]`` on the first sequences."""
    import torch
    from hygon_attn_backend import reference
    n = min(prob.batch, CHECK_SEQS)
    kview, vview = prob.kv_views()
    args = (prob.q[:n], kview, vview, prob.block_table[:n], prob.seq_lens[:n])
    ref32 = reference.paged_decode_attention(*args, scale=prob.scale, out=torch.empty(
        prob.q[:n].shape, dtype=torch.float32, device=prob.q.device), **prob.scales())
    ref_lowp = reference.paged_decode_attention(*args, scale=prob.scale,
                                                compute_dtype=prob.q.dtype, **prob.scales())
    return _budget(out[:n], ref32, ref_lowp, str(prob.q.dtype).split(".")[-1])


def check_prefill(prob: PrefillProblem, out) -> tuple:
    """``(ok, max error, budget)`` of ``out [B * extend, Hq, D]`` on the last query rows
    of the first request (each row sees the keys its position allows)."""
    import torch
    from hygon_attn_backend import reference
    m = min(prob.extend, CHECK_ROWS)
    rows = slice(prob.extend - m, prob.extend)
    dev = prob.q.device
    kview, vview = prob.kv_views()
    cu = torch.tensor([0, m], dtype=torch.int32, device=dev)
    args = (prob.q[rows], kview, vview, prob.block_table[:1], cu, prob.seq_lens_k[:1])
    ref32 = reference.prefix_prefill_attention(
        *args, scale=prob.scale, out=torch.empty(prob.q[rows].shape, dtype=torch.float32,
                                                 device=dev), **prob.scales())
    ref_lowp = reference.prefix_prefill_attention(*args, scale=prob.scale,
                                                  compute_dtype=prob.q.dtype, **prob.scales())
    return _budget(out[rows], ref32, ref_lowp, str(prob.q.dtype).split(".")[-1])
