"""The engines' own attention kernels as benchmark peers, called the way each engine's
backend calls them, with the metadata that backend builds (built here before timing).

* ``sglang``: ``decode_attention_fwd`` / ``extend_attention_fwd`` of
  ``sglang.kernels.ops.attention`` (SGLang 0.5.23), as its Triton backend
  (``sglang/srt/layers/attention/triton_backend.py``) calls them: ``kv_indptr`` the
  cumulative key lengths (int32), ``kv_indices`` the token-level slots of the keys
  (``page * P + offset``, int64; for extend only the prefix), the KV buffers the pool's
  ``[num_slots, Hkv, D]`` rows with ``page_size=P``, ``num_kv_splits`` from SGLang's own
  ``get_num_kv_splits_triton`` with the server default of 8 maximum splits and the
  device's multiprocessor count, ``use_pdl`` on compute capability >= 9 as
  ``is_arch_support_pdl`` decides, and the ``uneven_batch`` flag tensor.
* ``vllm``: ``unified_attention`` of ``vllm/v1/attention/ops/triton_unified_attention.py``
  (vLLM 0.32) with the split-softmax scratch its Triton backend allocates: the 3-D
  (segmented) kernel runs when ``num_seqs <= 128 // Hkv`` for decode, the 2-D kernel
  otherwise and for every prefill, the choice ``unified_attention`` makes from those
  arguments.
* ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-graph buffers) and
  ``BatchPrefillWithPagedKVCacheWrapper`` in ``NHD`` layout, ``plan`` called once.
"""

from __future__ import annotations

import os

from hygon_attn_backend.tools.bench._runner import Runner, Unavailable

LABELS = {"sglang": "sglang triton", "vllm": "vllm unified", "flashinfer": "flashinfer"}
SGLANG_MAX_KV_SPLITS = 8  # server default of --triton-attention-num-kv-splits
VLLM_MIN_LAUNCH_GRID_SIZE_2D = 128  # vllm/v1/attention/backends/triton_attn.py
VLLM_NUM_PAR_SOFTMAX_SEGMENTS = 16
FLASHINFER_WORKSPACE_BYTES = 256 << 20


def _require(module: str, device) -> None:
    """Installed, and a GPU (or Triton's interpreter on a CPU tensor, to check wiring)."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        raise Unavailable("not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Unavailable("needs a CUDA GPU (or TRITON_INTERPRET=1)")


def _import(what: str, module: str):
    import importlib
    try:
        return getattr(importlib.import_module(module), what)
    except Exception as exc:  # an engine whose import chain breaks here
        raise Unavailable(f"import failed: {type(exc).__name__}: {str(exc)[:120]}") from exc


def flashinfer_module(name: str):
    """``flashinfer.<name>``, imported without ``flashinfer/__init__.py``, which imports every
    kernel family (and packages a GPU image may lack): when ``flashinfer`` is not imported
    yet, a bare package module whose ``__path__`` is the installed folder stands in for it,
    so only ``<name>`` and what it imports load. :class:`Unavailable` when it is not
    installed or its import fails."""
    import importlib
    import importlib.util
    import sys
    import types
    if "flashinfer" not in sys.modules:
        spec = importlib.util.find_spec("flashinfer")
        if spec is None or not spec.submodule_search_locations:
            raise Unavailable("not installed")
        pkg = types.ModuleType("flashinfer")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__package__ = "flashinfer"
        # its JIT looks itself up (importlib.util.find_spec("flashinfer")), which needs a spec
        pkg.__spec__ = spec
        pkg.__file__ = spec.origin
        sys.modules["flashinfer"] = pkg
    try:
        return importlib.import_module(f"flashinfer.{name}")
    except Exception as exc:  # a module of its import chain that the machine lacks
        raise Unavailable(f"import failed: {type(exc).__name__}: {str(exc)[:120]}") from exc


def _num_sms(device) -> int:
    import torch
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _indptr(lengths, device):
    import torch
    ptr = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=device)
    ptr[1:] = torch.cumsum(lengths.to(torch.int64), 0).to(torch.int32)
    return ptr


def _sglang_use_pdl(device) -> bool:
    import torch
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# ----------------------------------------------------------------------------- sglang

def sglang_decode(prob) -> Runner:
    import torch
    dev = prob.q.device
    _require("sglang", dev)
    decode_fwd = _import("decode_attention_fwd", "sglang.kernels.ops.attention.decode_attention")
    splits_kernel = _import("get_num_kv_splits_triton", "sglang.kernels.ops.attention.metadata")
    import triton
    b, hq, hkv, d = prob.batch, prob.num_q_heads, prob.num_kv_heads, prob.head_dim
    k_buf = prob.k_store.view(-1, hkv, d)  # the pool's [num_slots, Hkv, D] rows
    v_buf = prob.v_store.view(-1, hkv, d)
    kv_indptr = _indptr(prob.seq_lens, dev)
    kv_indices = prob.token_slots().reshape(-1).contiguous()  # int64 token slots
    num_kv_splits = torch.empty(b, dtype=torch.int32, device=dev)
    uneven = torch.zeros(1, dtype=torch.int32, device=dev)
    splits_kernel[(1,)](num_kv_splits, prob.seq_lens, b, 1, hq, hkv, SGLANG_MAX_KV_SPLITS,
                        _num_sms(dev), MAX_NUM_SEQ=256 if b < 256 else triton.next_power_of_2(b),
                        uneven_batch_ptr=uneven)
    attn_logits = torch.empty(b, hq, SGLANG_MAX_KV_SPLITS, d, dtype=torch.float32, device=dev)
    attn_lse = torch.empty(b, hq, SGLANG_MAX_KV_SPLITS, dtype=torch.float32, device=dev)
    out = torch.empty_like(prob.q)
    use_pdl = _sglang_use_pdl(dev)

    def call(pdl):
        decode_fwd(prob.q, k_buf, v_buf, out, kv_indptr, kv_indices, attn_logits, attn_lse,
                   num_kv_splits, SGLANG_MAX_KV_SPLITS, prob.scale, prob.k_scale, prob.v_scale,
                   use_pdl=pdl, page_size=prob.page_size, uneven_batch=uneven)
    pdl_note = ", PDL" if use_pdl else ""
    if use_pdl:
        try:
            call(True)
        except Exception as exc:  # a Triton without programmatic dependent launch
            use_pdl, pdl_note = False, f", PDL off ({type(exc).__name__})"
    fn = lambda: call(use_pdl)
    splits = sorted(set(num_kv_splits.tolist()))
    note = f"kv splits {','.join(map(str, splits))}{pdl_note}"
    return Runner(LABELS["sglang"], fn, out, note=note,
                  keep=[kv_indptr, kv_indices, num_kv_splits, attn_logits, attn_lse, uneven])


def sglang_prefill(prob) -> Runner:
    import torch
    dev = prob.q.device
    _require("sglang", dev)
    extend_fwd = _import("extend_attention_fwd", "sglang.kernels.ops.attention.extend_attention")
    b, hkv, d = prob.batch, prob.num_kv_heads, prob.head_dim
    k_buf = prob.k_store.view(-1, hkv, d)
    v_buf = prob.v_store.view(-1, hkv, d)
    qo_indptr = prob.cu_seqlens_q.to(torch.int64)
    prefix_lens = torch.full((b,), prob.prefix, dtype=torch.int32, device=dev)
    kv_indptr = _indptr(prefix_lens, dev)
    kv_indices = prob.token_slots(0, prob.prefix).reshape(-1).contiguous()
    out = torch.empty_like(prob.q)
    extend_cpu = [prob.extend] * b

    def fn():
        extend_fwd(prob.q, prob.k_new, prob.v_new, out, k_buf, v_buf, qo_indptr, kv_indptr,
                   kv_indices, None, True, None, prob.extend, prob.k_scale, prob.v_scale,
                   sm_scale=prob.scale,
                   page_size=prob.page_size, extend_seq_lens_cpu=extend_cpu)
    return Runner(LABELS["sglang"], fn, out, note="new K/V dense",
                  keep=[qo_indptr, kv_indptr, kv_indices])


# ----------------------------------------------------------------------------- vllm

def _vllm_call(prob, *, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, threshold):
    import torch
    dev = prob.q.device
    unified = _import("unified_attention", "vllm.v1.attention.ops.triton_unified_attention")
    import triton
    hq, hkv, d = prob.num_q_heads, prob.num_kv_heads, prob.head_dim
    segs = VLLM_NUM_PAR_SOFTMAX_SEGMENTS
    rows = max(1, threshold)
    f32 = dict(dtype=torch.float32, device=dev)
    segm_out = torch.empty(rows, hq, segs, triton.next_power_of_2(d), **f32)
    segm_max = torch.empty(rows, hq, segs, **f32)
    segm_sum = torch.empty(rows, hq, segs, **f32)
    b = seqused_k.shape[0]
    # per-tensor fp8 scales (1 for a 16-bit cache), as vLLM's [B, Hkv] descale views
    k_one = torch.full((1, 1), prob.k_scale, **f32)
    v_one = torch.full((1, 1), prob.v_scale, **f32)
    k_descale, v_descale = k_one.expand(b, hkv), v_one.expand(b, hkv)
    out = torch.empty_like(prob.q)

    def fn():
        unified(q=prob.q, k=prob.k_store, v=prob.v_store, out=out, cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q, seqused_k=seqused_k, max_seqlen_k=max_seqlen_k,
                softmax_scale=prob.scale, causal=True, window_size=(-1, -1),
                block_table=prob.block_table, softcap=0, q_descale=None, k_descale=k_descale,
                v_descale=v_descale, seq_threshold_3D=threshold,
                num_par_softmax_segments=segs, softmax_segm_output=segm_out,
                softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)
    use_3d = max_seqlen_q == 1 and b <= threshold
    return Runner(LABELS["vllm"], fn, out, note="3-D kernel" if use_3d else "2-D kernel",
                  keep=[segm_out, segm_max, segm_sum, cu_seqlens_q, k_one, v_one])


def _vllm_threshold(num_kv_heads: int) -> int:
    """``seq_threshold_3D`` as vLLM's Triton backend sets it (its constant if importable)."""
    try:
        from vllm.v1.attention.backends import triton_attn
        grid = triton_attn.MIN_LAUNCH_GRID_SIZE_2D
    except Exception:  # the constant moved: use the value read from 0.32
        grid = VLLM_MIN_LAUNCH_GRID_SIZE_2D
    return grid // num_kv_heads


def _require_vllm(dev) -> None:
    _require("vllm", dev)
    if dev.type != "cuda":  # vLLM swaps Triton for a placeholder on a CPU-only machine
        raise Unavailable("needs a CUDA GPU (vLLM disables Triton without one)")


def vllm_decode(prob) -> Runner:
    import torch
    dev = prob.q.device
    _require_vllm(dev)
    cu = torch.arange(prob.batch + 1, dtype=torch.int32, device=dev)
    return _vllm_call(prob, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=prob.seq_lens,
                      max_seqlen_k=prob.ctx, threshold=_vllm_threshold(prob.num_kv_heads))


def vllm_prefill(prob) -> Runner:
    _require_vllm(prob.q.device)
    return _vllm_call(prob, cu_seqlens_q=prob.cu_seqlens_q, max_seqlen_q=prob.extend,
                      seqused_k=prob.seq_lens_k, max_seqlen_k=prob.prefix + prob.extend,
                      threshold=_vllm_threshold(prob.num_kv_heads))


# ----------------------------------------------------------------------------- flashinfer

def _flashinfer_setup(prob, wrapper_name: str, length: int, module: str = ""):
    """FlashInfer's paged-KV wrapper class ``wrapper_name`` (of ``flashinfer``, or of its
    submodule ``module`` alone: :func:`flashinfer_module`), its workspace, and the page
    description of ``prob``'s batch (every request ``length`` keys):
    ``(wrapper_cls, workspace, indptr, indices, last_page_len)``."""
    import torch
    dev = prob.q.device
    if dev.type != "cuda":
        raise Unavailable("needs a CUDA GPU")
    _require("flashinfer", dev)
    if module:
        wrapper_cls = getattr(flashinfer_module(module), wrapper_name)
    else:
        wrapper_cls = _import(wrapper_name, "flashinfer")
    per = -(-length // prob.page_size)
    indptr = torch.arange(prob.batch + 1, dtype=torch.int32, device=dev) * per
    indices = prob.block_table[:, :per].reshape(-1).to(torch.int32).contiguous()
    last = torch.full((prob.batch,), (length - 1) % prob.page_size + 1, dtype=torch.int32,
                      device=dev)
    ws = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    return wrapper_cls, ws, indptr, indices, last


def _flashinfer_runner(prob, wrapper, *keep) -> Runner:
    import torch
    out = torch.empty_like(prob.q)
    scales = dict(k_scale=prob.k_scale, v_scale=prob.v_scale) if prob.fp8 else {}
    fn = lambda: wrapper.run(prob.q, (prob.k_store, prob.v_store), out=out, **scales)
    return Runner(LABELS["flashinfer"], fn, out, keep=[wrapper, *keep])


def flashinfer_decode(prob) -> Runner:
    wrapper_cls, ws, indptr, indices, last = _flashinfer_setup(
        prob, "BatchDecodeWithPagedKVCacheWrapper", prob.ctx)
    wrapper = wrapper_cls(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                          paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr, indices, last, prob.num_q_heads, prob.num_kv_heads, prob.head_dim,
                 prob.page_size, pos_encoding_mode="NONE", sm_scale=prob.scale,
                 q_data_type=prob.q.dtype, kv_data_type=prob.k_store.dtype)
    return _flashinfer_runner(prob, wrapper, ws, indptr, indices, last)


def flashinfer_prefill(prob) -> Runner:
    wrapper_cls, ws, indptr, indices, last = _flashinfer_setup(
        prob, "BatchPrefillWithPagedKVCacheWrapper", prob.prefix + prob.extend)
    wrapper = wrapper_cls(ws, "NHD")
    wrapper.plan(prob.cu_seqlens_q, indptr, indices, last, prob.num_q_heads,
                 prob.num_kv_heads, prob.head_dim, prob.page_size, causal=True,
                 sm_scale=prob.scale, q_data_type=prob.q.dtype,
                 kv_data_type=prob.k_store.dtype)
    return _flashinfer_runner(prob, wrapper, ws, indptr, indices, last)