"""Every vLLM interface difference the integration adapts to, in one place.

Each adapter keys on the capability itself (whether vLLM has a name, what a signature
takes) where it can, and on a version range only where behaviour changes without a
visible interface change. The supported range is :data:`SUPPORTED_RANGE`;
``scripts/compat/run.py`` measures every listed version (``docs/compat.md``).

The differences, as read in each measured version's source (``x.y and older`` means
the oldest measured, 0.15, up to x.y):

=====================================  ======================  ==============================
vLLM piece                             differs                 adapter
=====================================  ======================  ==============================
``backend.max_decode_query_len``       absent in 0.28, older   :func:`max_decode_query_len`
                                                               (the builder's threshold)
``backends.utils.get_num_attention_``  absent in 0.21, older   :func:`num_attention_heads`
``heads_from_layers``                                          (the model-wide count)
``kv_cache_interface.KVCacheLayout``   absent in 0.28, older   :func:`kv_cache_layout_enum`
                                                               is None: no layouts declared
``AttentionBackend.get_kv_cache_``     abstract in 0.28 and    the backend always defines it
``shape``                              older, gone in 0.32     (logical = physical shape)
``supports_combination`` positionals   8 in 0.21 and older     the backend takes both (its
                                       (no use_mm_prefix)      tail is ``*rest``)
``CpuPlatform.get_attn_backend_cls``   no ``num_heads`` in     :func:`call_with_supported`
                                       0.15
CPU selector ignores the selection     0.15 to 0.34            ``cpu_platform`` wrapper,
                                                               :data:`CPU_PATCH_RANGE`
``AttentionBackend.accept_output_``    read (default False)    the backend declares True
``buffer``                             in 0.18 and older       (forward fills ``output``)
``AttentionBackendEnum.register``      absent in 0.28, older   :func:`can_add_members`: with
                                                               ``CUSTOM`` taken, refuse
``parallel_state.get_dcp_world_``     absent in 0.15          :func:`dcp_world_and_rank`
``size_and_rank``                                              (one rank there: no DCP)
MLA scaffolding in ``model_executor.`` 0.15 to 0.32 (read and  ``mla_select``: the MLA
``layers.attention.mla_attention``     tested there)            backend only in
                                                               :data:`MLA_RANGE`
The MLA layer's calls into the impl    0.15: one ``forward``    ``HygonMLAImpl.forward`` runs
                                       (cache write, both       the layer's flow there, and
                                       paths, projections);     ``_forward_decode`` is
                                       0.18+: ``forward_mha``,  ``forward_mqa``
                                       ``forward_mqa``
``MLACommonImpl.__init__``             0.15, 0.18 pick a GPU    :func:`init_mla_common_impl`
                                       prefill kernel, fail
                                       without flash-attn
MLA context chunks of a prefill batch  0.25 and older: stacked  :func:`mla_context_chunks`
                                       per-chunk rows over all  (one object a chunk, as
                                       prefills; 0.28: a list   0.28's)
                                       of ``ContextChunk``
``MLACommonMetadataBuilder._build_``   no ``max_query_len`` in  the builder takes it as an
``decode``                             0.28 and older (vLLM     optional keyword
                                       calls it by keyword)
``MLACommonMetadataBuilder.page_size`` set only on CUDA in      the builder reads
                                       0.15 to 0.21             ``kv_cache_spec.block_size``
MLA prefill backend of the layer       none in 0.15, 0.18; no   ``mla_prefill``: a
(``get_mla_prefill_backend``)          CPU one 0.21 to 0.28:    placeholder where vLLM's
                                       CPU gets FlashAttention  choice is unusable
                                       (unusable there)
=====================================  ======================  ==============================

Everything here imports vLLM lazily: :mod:`.` (``register``) must stay cheap.
"""

from __future__ import annotations

import inspect
from typing import Tuple

from hygon_attn_backend.integrations._patch import version_tuple  # noqa: F401 (re-export)

Version = Tuple[int, int]

#: vLLM (major, minor) versions the integration supports, inclusive at both ends.
SUPPORTED_RANGE: Tuple[Version, Version] = ((0, 15), (0, 34))
#: vLLM versions whose CPU platform ignores the selected backend (the patch applies).
CPU_PATCH_RANGE: Tuple[Version, Version] = ((0, 15), (0, 34))
#: vLLM versions whose MLA interfaces the MLA backend (``mla.py``) was written and tested
#: against; elsewhere ``hygon`` on an MLA model is refused by vLLM's own validation.
MLA_RANGE: Tuple[Version, Version] = ((0, 15), (0, 32))


def in_range(version, bounds: Tuple[Version, Version]) -> bool:
    v = version_tuple(version)
    return v is not None and bounds[0] <= v <= bounds[1]


def range_text(bounds: Tuple[Version, Version]) -> str:
    (a, b), (c, d) = bounds
    return f"{a}.{b} to {c}.{d}"


def missing_capabilities() -> list[str]:
    """What this vLLM lacks that registration needs (empty when registration can run).

    Checked before anything is changed, so an unsupportable vLLM is left untouched."""
    missing = []
    try:
        from vllm.v1.attention.backends import registry
    except Exception as exc:  # older layouts (vllm.attention.backends) or a broken install
        return [f"vllm.v1.attention.backends.registry does not import ({exc})"]
    enum = getattr(registry, "AttentionBackendEnum", None)
    if enum is None or "CUSTOM" not in enum.__members__:
        missing.append("AttentionBackendEnum.CUSTOM")
    elif not all(hasattr(enum.CUSTOM, m) for m in ("get_path", "is_overridden")):
        missing.append("AttentionBackendEnum.get_path/is_overridden")
    if not callable(getattr(registry, "register_backend", None)):
        missing.append("register_backend")
    return missing


def can_add_members() -> bool:
    """Whether ``register_backend("NAME", path)`` creates a new enum member."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return callable(getattr(AttentionBackendEnum, "register", None))


def _optional(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def kv_cache_layout_enum():
    """vLLM's ``KVCacheLayout`` enum, or None where vLLM has none (the runner then takes
    the backend's ``get_kv_cache_shape``)."""
    return _optional("vllm.v1.kv_cache_interface", "KVCacheLayout")


def max_decode_query_len(vllm_config, builder) -> int:
    """Most tokens a decode request of this engine carries (1 + speculative tokens).

    vLLM's own function where it exists; else the builder's reorder threshold, which
    ``_init_reorder_batch_threshold(1, supports_spec_as_decode=True)`` set from the same
    speculative config."""
    fn = _optional("vllm.v1.attention.backend", "max_decode_query_len")
    if fn is not None:
        return int(fn(vllm_config))
    return int(builder.reorder_batch_threshold or 1)


def num_attention_heads(vllm_config, layer_names) -> int:
    """Query heads per rank of the named layers (vLLM's per-layer count where it exists,
    else the model-wide count)."""
    fn = _optional("vllm.v1.attention.backends.utils", "get_num_attention_heads_from_layers")
    heads = fn(vllm_config, layer_names) if fn is not None else None
    return heads or vllm_config.model_config.get_num_attention_heads(
        vllm_config.parallel_config)


def dcp_world_and_rank(kv_cache_spec, parallel_config) -> Tuple[int, int]:
    """``(world, rank)`` of this rank's decode-context-parallel group for a cache spec.

    vLLM's ``get_dcp_world_size_and_rank`` where it exists (a cache it does not shard, such
    as a replicated draft's, is one rank). Without it (0.15) there is no DCP in our
    integration: ``(1, 0)``, and a DCP size above 1 is refused by name."""
    fn = _optional("vllm.distributed.parallel_state", "get_dcp_world_size_and_rank")
    if fn is not None:
        return fn(getattr(kv_cache_spec, "dcp_sharded", True))
    size = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
    if size > 1:
        raise NotImplementedError(
            f"decode_context_parallel_size={size}: this vLLM has no "
            f"get_dcp_world_size_and_rank, which the hygon backend's DCP path needs "
            f"(a newer vLLM)")
    return 1, 0


def call_with_supported(func, *args, **kwargs):
    """Call ``func`` with only the keyword arguments its signature names."""
    params = inspect.signature(func).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return func(*args, **kwargs)


def mla_context_chunks(prefill) -> list:
    """The context chunks of one MLA prefill batch (vLLM's ``MLACommonPrefillMetadata``,
    or None) as objects with the fields :func:`.mla_step.context` reads; empty when no
    prefill has a cached context.

    vLLM 0.28 and newer have a list of ``ContextChunk`` objects (``chunked_context.
    chunks``), each over a run of prefills, which pass as they are. Older ones (read in
    0.15, 0.18, 0.21 and 0.25) hold stacked rows: chunk ``i`` covers every prefill
    (``cu_seq_lens[i]`` ``[P + 1]``, ``starts[i]`` ``[P]``, ``token_to_seq[i]`` padded to
    the longest chunk, ``seq_tot[i]`` its context rows), a prefill whose context ends
    earlier having none in it; each becomes one :class:`~.mla_step.ContextChunk` over all
    the prefill rows."""
    chunked = None if prefill is None else prefill.chunked_context
    if chunked is None:
        return []
    chunks = getattr(chunked, "chunks", None)
    if chunks is not None:
        return list(chunks)
    from .mla_step import ContextChunk

    every = slice(None)
    return [ContextChunk(token_slice=every, query_start_loc=prefill.query_start_loc,
                         request_slice=every, cu_seq_lens=chunked.cu_seq_lens[i],
                         starts=chunked.starts[i],
                         token_to_seq=chunked.token_to_seq[i, :int(total)])
            for i, total in enumerate(chunked.seq_tot) if int(total) > 0]


def init_mla_common_impl(init, impl, *args, **kwargs) -> None:
    """Run vLLM's ``MLACommonImpl.__init__`` (``init``, bound to ``impl``) with ``args``.

    vLLM 0.15 and 0.18's (read in 0.15.1, 0.18.1) end by choosing a GPU prefill kernel
    for vLLM's own prefill (``_run_prefill_new_tokens_fa`` and its kin on the class:
    FlashAttention, FlashInfer, cuDNN, TRT-LLM) and fail when there is none, as on a CPU
    (0.18: a RuntimeError naming FlashAttention; 0.15: a NameError for
    ``flash_attn_varlen_func``, which its CPU build never imports); every field the hygon
    impl and vLLM's MLA layer read is set before that choice, and the hygon impl never
    runs that prefill. Where the class has that choice and it raises so, the two fields
    after it are set as vLLM sets them (``dcp_world_size`` -1, which the layer fills in;
    ``cp_kv_cache_interleave_size`` from the config). 0.21 and newer choose no prefill
    kernel in the impl: ``init`` as it is."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl

    try:
        init(*args, **kwargs)
    except (RuntimeError, NameError) as exc:  # 0.18: RuntimeError; 0.15: NameError
        if not (hasattr(MLACommonImpl, "_run_prefill_new_tokens_fa")
                and ("FlashAttention" in str(exc) or "flash_attn_varlen_func" in str(exc))):
            raise
        from vllm.config import get_current_vllm_config

        impl.dcp_world_size = -1
        impl.cp_kv_cache_interleave_size = (
            get_current_vllm_config().parallel_config.cp_kv_cache_interleave_size)
