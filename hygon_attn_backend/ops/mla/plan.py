"""Plan once per step, launch per layer: the MLA decode plan and its split-KV workspace.

:func:`plan_mla_decode` decides everything that depends only on the batch (the
implementation, the launch configuration and split count, the workspace, the block table
and lengths); :meth:`MLADecodePlan.run`, called once per layer, checks only what a layer
can change (the query, cache and outputs it passes) and launches: no host sync, and no
allocation when ``out`` (and ``lse``, for an LSE plan) are given, so it can be captured
in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import num_sms_of
from hygon_attn_backend.ops.mla import native, triton, tuning
from hygon_attn_backend.ops.mla.tuning import MLAConfig
from hygon_attn_backend.ops.tree_mask import check_tree_mask

__all__ = ["MLADecodePlan", "MLADecodeWorkspace", "MLAConfig", "plan_mla_decode",
           "allocate_mla_decode_workspace"]

ScaleLike = _checks.ScaleLike


@dataclass
class MLADecodeWorkspace:
    """Scratch of the split-KV MLA decode, allocated once and reused (CUDA-graph safe).

    Slot ``seq * num_partitions + part`` holds one partition of one request; row
    ``t * num_q_heads + h`` one query row.

    max_logits, exp_sums: ``[num_slots, num_rows]`` float32 (running max in log2 units,
       running sum). partial_out: ``[num_slots, num_rows, kv_lora_rank]`` float32.
    """

    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    partial_out: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.max_logits.shape[0]


def allocate_mla_decode_workspace(*, max_num_seqs: int, num_q_heads: int, kv_lora_rank: int,
                                  max_context_len: int, device, num_tokens: int = 1,
                                  num_slots: Optional[int] = None) -> MLADecodeWorkspace:
    """Allocate the split-KV scratch for every batch of ``<= max_num_seqs`` requests,
    contexts up to ``max_context_len`` and ``num_tokens`` query tokens a request (the
    largest ``num_seqs * num_partitions`` the default rule picks over that range; pass
    ``num_slots`` to size it yourself)."""
    device = torch.device(device)
    if num_slots is None:
        sms = num_sms_of(device)
        num_slots = 1
        for seqs in range(1, max_num_seqs + 1):
            parts = tuning.workspace_partitions(
                num_seqs=seqs, num_q_heads=num_q_heads, num_tokens=num_tokens,
                max_context_len=max_context_len, num_sms=sms)
            if parts > 1:
                num_slots = max(num_slots, seqs * parts)
    rows = num_tokens * num_q_heads
    f32 = dict(dtype=torch.float32, device=device)
    return MLADecodeWorkspace(max_logits=torch.empty((num_slots, rows), **f32),
                              exp_sums=torch.empty((num_slots, rows), **f32),
                              partial_out=torch.empty((num_slots, rows, kv_lora_rank), **f32))


def _check_workspace(ws, slots: int, rows: int, rank: int, device) -> None:
    if not isinstance(ws, MLADecodeWorkspace):
        raise ValueError(f"workspace must be an MLADecodeWorkspace "
                         f"(allocate_mla_decode_workspace), got {type(ws).__name__}")
    for name in ("max_logits", "exp_sums", "partial_out"):
        t = getattr(ws, name)
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"workspace.{name} must be float32 on {device}, got "
                             f"{_checks.describe(t)}")
    if ws.max_logits.dim() != 2 or ws.exp_sums.shape != ws.max_logits.shape or \
            ws.partial_out.dim() != 3 or ws.max_logits.shape[0] < slots or \
            ws.max_logits.shape[1] < rows or ws.partial_out.shape[0] < slots or \
            ws.partial_out.shape[1] < rows or ws.partial_out.shape[2] < rank:
        raise ValueError(f"workspace too small: this batch needs {slots} slots x {rows} rows x "
                         f"{rank} values, got max_logits {tuple(ws.max_logits.shape)}, "
                         f"partial_out {tuple(ws.partial_out.shape)} "
                         f"(allocate_mla_decode_workspace)")


@dataclass(eq=False)
class MLADecodePlan:
    """An MLA decode planned for one batch; :meth:`run` per layer.

    Built by :func:`plan_mla_decode`. Holds the batch's ``block_table`` and ``seq_lens``,
    the resolved ``impl`` (``"native"``, ``"triton"`` or ``"reference"``; what was asked
    is ``impl_requested``), the softmax ``scale``, the
    launch ``config`` (None: nothing to launch) and the split-KV ``workspace``.
    """

    impl: str
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_seqs: int
    num_tokens: int
    num_q_heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_seq_len: int
    scale: float
    return_lse: bool
    config: Optional[MLAConfig]
    workspace: Optional[MLADecodeWorkspace]
    impl_requested: str = "auto"
    #: ``[num_seqs * num_tokens, W]`` int32 packed tree mask of a verify batch (the drafts
    #: are each request's last ``num_tokens`` keys; ``ops.tree_mask``); None: causal drafts
    tree_mask: Optional[torch.Tensor] = None
    _variants: Dict[bool, tuple] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        """A latent row's width, ``kv_lora_rank + rope_dim`` (q's last dim)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_launches(self) -> int:
        """Kernel launches a :meth:`run` (decode, and the combine of a split launch)."""
        if self.impl not in ("triton", "native") or self.config is None:
            return 0
        return 2 if self.config.split else 1

    def out_shape(self) -> tuple:
        lead = (self.num_seqs,) if self.num_tokens == 1 else (self.num_seqs, self.num_tokens)
        return lead + (self.num_q_heads, self.kv_lora_rank)

    def _check_call(self, q, kv_cache, out, lse) -> None:
        """What a layer may get wrong against the plan (cheap: shapes and dtypes only)."""
        lead = (self.num_seqs, self.num_tokens)
        if not isinstance(q, torch.Tensor) or q.dtype != self.q_dtype or \
                q.device != self.device or not (
                    tuple(q.shape) == lead + (self.num_q_heads, self.width) or
                    (self.num_tokens == 1 and
                     tuple(q.shape) == (self.num_seqs, self.num_q_heads, self.width))):
            want = lead + (self.num_q_heads, self.width)
            raise ValueError(f"q: the plan was built for {want} (or without the token axis "
                             f"when T = 1) of {self.q_dtype} on {self.device}, got "
                             f"{_checks.describe(q) if isinstance(q, torch.Tensor) else q!r}")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or \
                kv_cache.dtype != self.kv_dtype or kv_cache.device != self.device or \
                tuple(kv_cache.shape[1:]) != (self.page_size, self.width):
            got = _checks.describe(kv_cache) if isinstance(kv_cache, torch.Tensor) \
                else repr(kv_cache)
            raise ValueError(f"kv_cache: the plan was built for [num_blocks, {self.page_size}, "
                             f"{self.width}] of {self.kv_dtype} on {self.device}, got {got}")
        want_out = q.shape[:-1] + (self.kv_lora_rank,)
        if out is not None:
            _checks.check_tensor("out", out, dtypes=(torch.float16, torch.bfloat16,
                                                     torch.float32),
                                 device=self.device, shape=tuple(want_out))
        if lse is not None:
            if not self.return_lse:
                raise ValueError("lse: the plan was built with return_lse=False "
                                 "(plan_mla_decode(return_lse=True) writes it)")
            _checks.check_tensor("lse", lse, dtypes=(torch.float32,), device=self.device,
                                 shape=tuple(q.shape[:-1]))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            kv_scale: ScaleLike = None):
        """MLA decode of one layer.

        q: ``[B, Hq, W]`` (T = 1) or ``[B, T, Hq, W]``, the plan's dtype, any strides.
        kv_cache: ``[num_blocks, page_size, W]`` (any strides), the plan's ``kv_dtype``.
        out: optional ``[B, (T,) Hq, kv_lora_rank]`` fp16/bf16/fp32 (q's leading shape),
           written in place; default a new tensor of q's dtype.
        lse: optional ``[B, (T,) Hq]`` float32 (a ``return_lse`` plan only; default a new
           tensor): each row's natural-log softmax normaliser, ``-inf`` for a row that
           sees no key.
        kv_scale: an fp8 cache's per-tensor scale, a float or a 1-element float32 tensor
           (read on the device: no sync); ignored for 16-bit caches.
        Returns ``out``, or ``(out, lse)`` for a ``return_lse`` plan.
        """
        self._check_call(q, kv_cache, out, lse)
        fp8 = self.kv_dtype in _checks.FP8_DTYPES
        if kv_scale is not None:
            kv_scale = _checks.check_scale("kv_scale", kv_scale, self.kv_dtype, self.device)
        if out is None:
            out = torch.empty(q.shape[:-1] + (self.kv_lora_rank,), dtype=q.dtype,
                              device=self.device)
        if self.return_lse and lse is None:
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=self.device)
        if self.impl == "reference":
            reference.mla_decode_attention(
                q, kv_cache, self.block_table, self.seq_lens, kv_lora_rank=self.kv_lora_rank,
                scale=self.scale, kv_scale=kv_scale if fp8 else None, out=out, lse=lse,
                tree_mask=self.tree_mask)
        elif self.config is None:  # an empty batch or table: no key is readable
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
            launches = self._variants.get(from_ptr)
            if launches is None:
                launches = self._variants[from_ptr] = triton.make_launches(self, from_ptr)
            value = float(kv_scale) if fp8 and kv_scale is not None and not from_ptr else 1.0
            if self.impl == "native":
                why = native.call_unsupported(q, kv_cache, out)
                if why is None:
                    native.launch(self, q, kv_cache, out, lse,
                                  kv_scale if from_ptr else None, value)
                    triton.run_combine(launches, out, lse)
                    return (out, lse) if self.return_lse else out
                if self.impl_requested == "native":
                    raise ValueError(f"impl='native' does not cover this call: {why}")
                # "auto" chose native and this call's tensors need Triton: the same config
                # and partitions
            triton.run(launches, q, kv_cache, out, lse, kv_scale if from_ptr else None, value)
        return (out, lse) if self.return_lse else out


def plan_mla_decode(*, block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                    num_q_heads: int, kv_lora_rank: int, rope_dim: int, q_dtype: torch.dtype,
                    kv_dtype: torch.dtype, num_tokens: int = 1, scale: Optional[float] = None,
                    max_seq_len: Optional[int] = None, return_lse: bool = False,
                    impl: str = "auto", workspace: Optional[MLADecodeWorkspace] = None,
                    tile=None, num_partitions: Optional[int] = None,
                    tree_mask: Optional[torch.Tensor] = None) -> MLADecodePlan:
    """Plan the MLA decode of one batch (once per step; every layer reuses the plan).

    block_table: ``[B, max_blocks]`` int32/int64 physical block ids (token ``j`` of request
       ``s`` is slot ``j % page_size`` of block ``block_table[s, j // page_size]``);
       seq_lens: ``[B]`` int32/int64 key lengths, the query tokens included (values read
       on the device only). The layers' calls read these same tensors.
    page_size: slots a block (1..256 tested; any >= 1).
    num_q_heads: Hq (16..128 in the models; any >= 1).
    kv_lora_rank, rope_dim: a latent row is ``[kv_c (kv_lora_rank) | k_pe (rope_dim)]``,
       e.g. 512 + 64; ``kv_lora_rank`` in 1..512, ``rope_dim`` in 0..128.
    q_dtype: float16 / bfloat16 (float32 runs the reference); kv_dtype: q_dtype or
       float8_e4m3fn / float8_e5m2 (with a per-tensor ``kv_scale`` a call).
    num_tokens: T query tokens a request (1; 2..4 for MTP verify; a draft tree's width):
       token ``t`` sits at ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``.
    scale: softmax scale (a finite float > 0), default ``1 / sqrt(kv_lora_rank +
       rope_dim)``; engines pass their model's own.
    max_seq_len: host-side bound of ``seq_lens`` sizing the split (default the table's
       capacity ``max_blocks * page_size``); a longer sequence gets the same answer.
    return_lse: the calls also return each row's LSE (``[B, (T,) Hq]`` float32).
    impl: ``"auto"`` (the native sm_90a kernel where ``tuning.native_preferred`` takes it
       and it covers the batch: H100/H200, 512 + 64 rows of q's 16-bit dtype or fp8,
       >= 33 query rows a request; else Triton on a GPU or under ``TRITON_INTERPRET=1``; else the
       reference) | ``"native"`` (raises where it does not cover the batch) | ``"triton"``
       | ``"reference"``. A call whose tensors the native kernel cannot take (rows not
       16-byte aligned, a float32 ``out``) runs Triton under ``"auto"``.
    workspace: split-KV scratch (:func:`allocate_mla_decode_workspace`) reused across
       steps; without it a split plan allocates its own here.
    tree_mask: ``[B * T, W]`` int32 packed tree mask of a speculative verify batch
       (``ops.tree_mask``: ``pack_tree_mask`` / ``tree_mask_from_parents``; rows of unit
       stride, ``32 * W >= T``, ``T <= 64``): token ``t`` sees the keys before the drafts and draft
       ``j`` (key ``seq_len - T + j``) iff bit ``j`` of its row is set; read on the device
       by every call (a CUDA graph's static buffer). The Triton kernel takes it (``"auto"``
       never picks the native one; ``"native"`` refuses it).
    tile / num_partitions: force the Triton launch ``(BLOCK_M, BLOCK_N, num_warps,
       num_stages)`` / the split count; default the rules of ``ops/mla/tuning.py``.

    Bounds: keys whose block id is outside ``[0, num_blocks)`` or whose column is past the
    table are absent (never read); a length ``<= 0`` gives zeros (LSE ``-inf``).
    """
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES)
    device = block_table.device
    num_seqs = block_table.shape[0]
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    for name, value in (("page_size", page_size), ("num_q_heads", num_q_heads),
                        ("kv_lora_rank", kv_lora_rank), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if kv_lora_rank > tuning.MLA_MAX_RANK:
        raise ValueError(f"kv_lora_rank must be <= {tuning.MLA_MAX_RANK}, got {kv_lora_rank}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or \
            not 0 <= rope_dim <= tuning.MLA_MAX_ROPE:
        raise ValueError(f"rope_dim must be an int in [0, {tuning.MLA_MAX_ROPE}], got "
                         f"{rope_dim!r}")
    if q_dtype not in _checks.Q_DTYPES:
        raise ValueError(f"q_dtype must be one of {[str(d) for d in _checks.Q_DTYPES]}, got "
                         f"{q_dtype}")
    if kv_dtype not in _checks.FP8_DTYPES and kv_dtype != q_dtype:
        raise ValueError(f"kv_dtype must be q_dtype ({q_dtype}) or fp8, got {kv_dtype}")
    _checks.check_softmax_scale(scale)
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or
                                    not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    if num_partitions is not None and (isinstance(num_partitions, bool) or
                                       not isinstance(num_partitions, int) or
                                       num_partitions <= 0):
        raise ValueError(f"num_partitions must be a positive int or None, got "
                         f"{num_partitions!r}")
    if tree_mask is not None:
        if num_tokens > tuning.MLA_MAX_TREE_DRAFTS:
            raise ValueError(f"num_tokens: an MLA verify under a tree mask takes at most "
                             f"{tuning.MLA_MAX_TREE_DRAFTS} drafts a request, got {num_tokens}")
        check_tree_mask(tree_mask, total_q=num_seqs * num_tokens, device=device,
                        longest=num_tokens)
    max_blocks = block_table.shape[1]
    max_context = max_seq_len if max_seq_len is not None else max_blocks * page_size
    choice = tuning.choose(device=device, impl=impl, num_seqs=num_seqs, max_blocks=max_blocks,
                           num_q_heads=num_q_heads, num_tokens=num_tokens,
                           kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, q_dtype=q_dtype,
                           kv_dtype=kv_dtype, max_context=max_context, tile=tile,
                           num_partitions=num_partitions, tree=tree_mask is not None)
    config = choice.config
    if config is not None and config.split:
        slots, rows = num_seqs * config.num_partitions, num_tokens * num_q_heads
        if workspace is None:
            workspace = allocate_mla_decode_workspace(
                max_num_seqs=num_seqs, num_q_heads=num_q_heads, kv_lora_rank=kv_lora_rank,
                max_context_len=max_context, device=device, num_tokens=num_tokens,
                num_slots=slots)
        _check_workspace(workspace, slots, rows, kv_lora_rank, device)
    elif workspace is not None and not isinstance(workspace, MLADecodeWorkspace):
        _check_workspace(workspace, 0, 0, 0, device)
    width = kv_lora_rank + rope_dim
    return MLADecodePlan(
        impl=choice.impl, block_table=block_table, seq_lens=seq_lens, num_seqs=num_seqs,
        num_tokens=num_tokens, num_q_heads=num_q_heads, kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
        device=device, max_seq_len=max_context,
        scale=float(scale) if scale is not None else width ** -0.5,
        return_lse=return_lse, config=config, workspace=workspace, impl_requested=impl,
        tree_mask=tree_mask)
