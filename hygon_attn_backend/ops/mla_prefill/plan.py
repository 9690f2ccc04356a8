"""Plan once per step (or per context chunk), launch per layer: the ragged-attention plan.

:func:`plan_ragged_attention` builds the ``(request, m_block)`` tile map of a ragged batch
(the prefix prefill's, ``ops.prefill.plan``) and chooses the config, once; :meth:`RaggedPlan.run`,
once per layer, checks only what a layer can change and launches
``kernels.mla_prefill.ragged_attention_kernel``. As there, the tile map is built on the
host from the lengths' host copies (checked there, copied over once) or, without them, on
the device with no host sync (safe before capturing a CUDA graph; nothing checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._interpreter import triton_computes
from hygon_attn_backend.ops.mla_prefill import native, triton, tuning
from hygon_attn_backend.ops.prefill.plan import tile_map, tile_map_host, check_host_lengths

__all__ = ["RaggedPlan", "plan_ragged_attention", "plan_mla_extend", "check_ragged_lengths"]


def check_ragged_lengths(cu_q: Sequence[int], cu_k: Sequence[int], *, total_q: int,
                         total_k: int) -> None:
    """Check a ragged batch's offsets from host lists (no device access).

    cu_q: ``cu_seqlens_q`` values (``B + 1``), cu_k: ``cu_seqlens_k`` values (``B + 1``):
    each starts at 0 and is non-decreasing; ``cu_q`` ends at ``total_q`` (every output row
    belongs to a request), ``cu_k`` at most at ``total_k`` (rows past it are not read).
    """
    for name, cu, total, exact in (("cu_seqlens_q", cu_q, total_q, True),
                                   ("cu_seqlens_k", cu_k, total_k, False)):
        if len(cu) and int(cu[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0]={int(cu[0])}")
        for b in range(len(cu) - 1):
            if cu[b + 1] < cu[b]:
                raise ValueError(f"{name} must be non-decreasing, got {name}[{b}]="
                                 f"{int(cu[b])} > {name}[{b + 1}]={int(cu[b + 1])}")
        last = int(cu[-1]) if len(cu) else 0
        if (exact and last != total) or last > total:
            what = "equal" if exact else "be at most"
            rows = "q.shape[0]" if exact else "k.shape[0]"
            raise ValueError(f"{name}[-1] ({last}) must {what} {rows} ({total})")


def _host_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass(eq=False)
class RaggedPlan:
    """Tile schedule and launch config of one ragged batch (reused by every layer).

    tile_req / tile_mblock: ``[max_tiles]`` int32 request and m-block of each tile
    (``-1``: an unused slot), ``max_tiles = cdiv(total_q, block_m // heads) + num_seqs``.
    cu_seqlens_q / cu_seqlens_k: the batch's tensors (a layer's call passes these same
    ones). config: :class:`tuning.Config`.
    """

    tile_req: torch.Tensor
    tile_mblock: torch.Tensor
    config: tuning.Config
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    total_q: int
    total_k: int
    num_seqs: int
    num_kv_heads: int
    group: int
    head_dim_qk: int
    head_dim_v: int
    #: the absorbed MLA extend's plan (:func:`plan_mla_extend`): keys from a paged latent
    #: cache of ``page_size`` slots a block, ``cu_seqlens_k`` holding ``seq_lens_k [B]``
    paged: bool = False
    page_size: int = 1
    #: what the caller asked for: a plan of ``"auto"`` that chose native runs a call the
    #: native kernel does not take (unaligned rows) on Triton; one of ``"native"`` raises
    impl_requested: str = "auto"
    #: impl "native": the persistent launch's int32 ``[2]`` work counter (zeros between
    #: launches; a plan's launches run one after another on one stream)
    sched: Optional[torch.Tensor] = None
    _launches: Dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def impl(self) -> str:
        return self.config.impl

    @property
    def num_q_heads(self) -> int:
        return self.group * self.num_kv_heads

    def check_call(self, q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
        """What a layer may get wrong against the plan (shapes only: no value checks)."""
        want_q = (self.total_q, self.num_q_heads, self.head_dim_qk)
        want_k = (self.total_k, self.num_kv_heads, self.head_dim_qk)
        want_v = (self.total_k, self.num_kv_heads, self.head_dim_v)
        for name, t, want in (("q", q, want_q), ("k", k, want_k), ("v", v, want_v)):
            if tuple(t.shape) != want:
                raise ValueError(f"plan was built for {name} of shape {want}, got "
                                 f"{_checks.describe(t)}")
        if cu_seqlens_q is not self.cu_seqlens_q or cu_seqlens_k is not self.cu_seqlens_k:
            raise ValueError("plan: cu_seqlens_q and cu_seqlens_k must be the tensors the "
                             "plan was built with")

    def _launch(self, scale, causal, return_lse, scale_from_ptr=False):
        key = (scale, bool(causal), bool(return_lse), bool(scale_from_ptr))
        launch = self._launches.get(key)
        if launch is None:
            _checks.check_softmax_scale(scale)
            config = self.config
            if config.impl == "native":  # a call it does not take: Triton on the same map
                config = config._replace(impl="triton", block_n=native.FALLBACK_TILE[1],
                                         num_warps=native.FALLBACK_TILE[2],
                                         num_stages=native.FALLBACK_TILE[3])
            launch = self._launches[key] = triton.make_ragged_launch(
                self, causal=causal, scale=scale, return_lse=return_lse,
                scale_from_ptr=scale_from_ptr, config=config)
        return launch

    def run_extend(self, q, kv_cache, block_table, *, scale=None, out=None,
                   return_lse=False, kv_scale=None):
        """Launch the absorbed MLA extend for one layer (arguments as
        :func:`ops.mla_prefill.mla_extend_attention`, already checked)."""
        if not self.paged:
            raise ValueError("run_extend needs a plan_mla_extend plan")
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], self.head_dim_v))
        if self.impl == "reference" or not triton_computes(q.dtype):
            return reference.mla_extend_attention(
                q, kv_cache, block_table, self.cu_seqlens_q, self.cu_seqlens_k,
                v_head_dim=self.head_dim_v, scale=scale, out=out, return_lse=return_lse,
                kv_scale=kv_scale)
        lse = (torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
               if return_lse else None)
        if self.total_q and self.tile_req.shape[0]:
            ks = kv_scale if kv_cache.dtype in _checks.FP8_DTYPES else None  # 16-bit: none
            triton.run_extend(self._launch(scale, True, return_lse, isinstance(ks, torch.Tensor)),
                              q, kv_cache, block_table, out, lse, self.head_dim_v, kv_scale=ks)
        return (out, lse) if return_lse else out

    def run(self, q, k, v, *, scale=None, causal=True, out=None, return_lse=False):
        """Launch for one layer (arguments as :func:`ops.mla_prefill.ragged_attention`,
        already checked; call it through that op with ``plan=``). Returns ``out`` or
        ``(out, lse)`` with ``lse [Hq, total_q]`` float32."""
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        if self.impl == "reference" or not triton_computes(q.dtype):
            return reference.ragged_attention(q, k, v, self.cu_seqlens_q, self.cu_seqlens_k,
                                              scale=scale, causal=causal, out=out,
                                              return_lse=return_lse)
        lse = (torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
               if return_lse else None)
        if self.paged:
            raise ValueError("a plan_mla_extend plan runs through run_extend")
        if not (self.total_q and self.tile_req.shape[0]):
            return (out, lse) if return_lse else out
        if self.impl == "native":
            why = native.call_unsupported(q, k, v, out)
            if why is None:
                native.launch(out, q, k, v, lse, self.cu_seqlens_q, self.cu_seqlens_k,
                              self.tile_req, self.tile_mblock, self.sched,
                              scale=scale if scale is not None
                              else 1.0 / math.sqrt(self.head_dim_qk), causal=causal)
                return (out, lse) if return_lse else out
            if self.impl_requested == "native":
                raise ValueError(f"impl='native' does not cover this call: {why}")
        triton.run_ragged(self._launch(scale, causal, return_lse), q, k, v, out, lse)
        return (out, lse) if return_lse else out


def plan_ragged_attention(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                          total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int,
                          head_dim_qk: int, head_dim_v: int,
                          host_cu_seqlens_q=None, host_cu_seqlens_k=None,
                          q_dtype: Optional[torch.dtype] = None,
                          tile: Optional[tuple] = None, impl: str = "auto") -> RaggedPlan:
    """Plan ragged attention for one batch (once per step, or per context chunk; every
    layer reuses it).

    cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32/int64 on the device (the layers' calls
    pass these same tensors). total_q / total_k: the rows of q and of k/v. num_q_heads,
    num_kv_heads (a divisor), head_dim_qk, head_dim_v: the heads' shapes, each head at most
    :data:`tuning.MAX_HEAD_DIM` wide. host_cu_seqlens_q / host_cu_seqlens_k: the same
    offsets on the host (list or CPU tensor), if the caller has them (engines do): given
    both, they are checked here (:func:`check_ragged_lengths`) and the tile map is built
    on the host and copied once; otherwise it is built on the device, no sync, unchecked.
    q_dtype: the queries' dtype, if known (float32 runs the reference). tile: force
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (else :func:`tuning.tile_config`).
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` | ``"reference"``. ``"native"`` is the
    prefill's sm_90a wgmma kernel in its ragged mode (``native.py``: q/k / v heads 128 /
    128 or 192 / 128, float16/bfloat16, GQA groups up to 64); on a GPU without it (HIP,
    not sm_90) it runs Triton, as the engines pass one ``HYGON_ATTN_IMPL`` to every op; on
    an sm_90 GPU a batch or call it does not cover raises. ``"auto"`` takes it where
    :func:`tuning.native_preferred` says so, unless ``tile`` forces a Triton tile.
    """
    num_seqs = _checks.check_cu_seqlens(cu_seqlens_q)
    _checks.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=cu_seqlens_q.device, shape=(num_seqs + 1,))
    for name, value in (("total_q", total_q), ("total_k", total_k)):
        if int(value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if num_kv_heads <= 0 or num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    for name, value in (("head_dim_qk", head_dim_qk), ("head_dim_v", head_dim_v)):
        if not 1 <= int(value) <= tuning.MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {tuning.MAX_HEAD_DIM}], got {value}")
    group = num_q_heads // num_kv_heads
    device = cu_seqlens_q.device
    cfg = tuning.choose(device=device, impl=impl, total_q=total_q, num_kv_heads=num_kv_heads,
                        group=group, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                        q_dtype=q_dtype, tile=tile, ragged=True)
    tok_m = cfg.block_m // cfg.heads
    max_tiles = -(-total_q // tok_m) + num_seqs
    if host_cu_seqlens_q is not None and host_cu_seqlens_k is not None:
        cu_q, cu_k = _host_list(host_cu_seqlens_q), _host_list(host_cu_seqlens_k)
        if len(cu_q) != num_seqs + 1 or len(cu_k) != num_seqs + 1:
            raise ValueError(f"host_cu_seqlens_q / host_cu_seqlens_k must hold {num_seqs + 1} "
                             f"entries like cu_seqlens_q, got {len(cu_q)} and {len(cu_k)}")
        check_ragged_lengths(cu_q, cu_k, total_q=total_q, total_k=total_k)
        row = -(-max_tiles // 4) * 4  # 16-byte aligned second row (see ops.prefill.plan)
        both = tile_map_host(cu_q, tok_m, row)
        tile_req, tile_mblock = both.to(device, non_blocking=True)[:, :max_tiles].unbind(0)
    else:
        tile_req, tile_mblock = tile_map(cu_seqlens_q.to(torch.int64), num_seqs, tok_m,
                                          max_tiles)
    return RaggedPlan(tile_req=tile_req, tile_mblock=tile_mblock, config=cfg,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      total_q=int(total_q), total_k=int(total_k), num_seqs=num_seqs,
                      num_kv_heads=num_kv_heads, group=group, head_dim_qk=int(head_dim_qk),
                      head_dim_v=int(head_dim_v), impl_requested=impl,
                      sched=torch.zeros(2, dtype=torch.int32, device=device)
                      if cfg.impl == "native" else None)


def plan_mla_extend(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, *, total_q: int,
                    num_q_heads: int, head_dim: int, v_head_dim: int, page_size: int,
                    host_cu_seqlens_q=None, host_seq_lens_k=None,
                    capacity: Optional[int] = None, q_dtype: Optional[torch.dtype] = None,
                    tile: Optional[tuple] = None, impl: str = "auto") -> RaggedPlan:
    """Plan the absorbed MLA extend for one batch (once per step; every layer reuses it).

    cu_seqlens_q: ``[B + 1]``, seq_lens_k: ``[B]`` int32/int64 on the device (the layers'
    calls pass these same tensors). total_q, num_q_heads: q's rows and heads; head_dim:
    the latent row (``kv_lora_rank + rope``, 576), v_head_dim: its value columns (512),
    each at most :data:`tuning.MAX_LATENT_DIM`; page_size: the cache's slots a block.
    host_cu_seqlens_q / host_seq_lens_k: host copies, if the caller has them: checked
    here (``Lk >= Lq``; ``capacity``, tokens a table row holds, if given) and the tile map
    built on the host; otherwise on the device, no sync, unchecked. q_dtype, tile, impl as
    :func:`plan_ragged_attention`.
    """
    num_seqs = _checks.check_cu_seqlens(cu_seqlens_q)
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=cu_seqlens_q.device, shape=(num_seqs,))
    if int(total_q) < 0 or num_q_heads <= 0:
        raise ValueError(f"total_q must be >= 0 and num_q_heads > 0, got {total_q}, "
                         f"{num_q_heads}")
    if int(page_size) < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size}")
    if not 1 <= int(v_head_dim) <= int(head_dim) <= tuning.MAX_LATENT_DIM:
        raise ValueError(f"need 1 <= v_head_dim <= head_dim <= {tuning.MAX_LATENT_DIM}, got "
                         f"head_dim={head_dim}, v_head_dim={v_head_dim}")
    device = cu_seqlens_q.device
    cfg = tuning.choose(device=device, impl=impl, total_q=total_q, num_kv_heads=1,
                        group=num_q_heads, head_dim_qk=head_dim, head_dim_v=v_head_dim,
                        q_dtype=q_dtype, tile=tile)
    tok_m = cfg.block_m // cfg.heads
    max_tiles = -(-total_q // tok_m) + num_seqs
    if host_cu_seqlens_q is not None:
        cu = _host_list(host_cu_seqlens_q)
        if host_seq_lens_k is not None:
            check_host_lengths(cu, _host_list(host_seq_lens_k), total_q=total_q,
                               capacity=capacity)
        row = -(-max_tiles // 4) * 4
        both = tile_map_host(cu, tok_m, row)
        tile_req, tile_mblock = both.to(device, non_blocking=True)[:, :max_tiles].unbind(0)
    else:
        tile_req, tile_mblock = tile_map(cu_seqlens_q.to(torch.int64), num_seqs, tok_m,
                                          max_tiles)
    return RaggedPlan(tile_req=tile_req, tile_mblock=tile_mblock, config=cfg,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=seq_lens_k,
                      total_q=int(total_q), total_k=0, num_seqs=num_seqs, num_kv_heads=1,
                      group=num_q_heads, head_dim_qk=int(head_dim),
                      head_dim_v=int(v_head_dim), paged=True, page_size=int(page_size))
