"""Every difference between the SGLang versions we support, in one place (0.5.10 .. 0.5.23).

Each adapter keys on the capability it needs (a module, an attribute, a method), not on
a version number; the version that introduced each form is noted beside it.

* **choices list** (:func:`choices_api`): ``sglang.srt.arg_groups.choices`` (0.5.23)
  or ``sglang.srt.server_args`` (0.5.10, 0.5.17) holds ``ATTENTION_BACKEND_CHOICES``
  and ``add_attention_backend_choices``.
* **plugin loader** (:func:`has_plugin_loader`): ``sglang.srt.plugins.load_plugins``
  (0.5.17 on) runs our entry point in every SGLang process. Without it (0.5.10) nothing
  of ours runs in the scheduler processes the Engine spawns, so :func:`install_spawn_hook`
  points SGLang's own extension point ``Engine.run_scheduler_process_func`` at
  :func:`run_scheduler_process`, which registers in the child (only when the server args
  select ``hygon``) and runs SGLang's function (patches/sglang-0.5.10-scheduler-spawn.md).
* **KV write location** (:func:`write_loc`): ``KVWriteLoc.for_layer`` (0.5.23),
  ``KVWriteLoc(out_cache_loc)`` (0.5.17), the bare ``out_cache_loc`` tensor (0.5.10,
  no ``KVWriteLoc``).
* **CUDA-graph hooks** (:class:`LegacyGraphHooks`): 0.5.17 on call
  ``init_forward_metadata_out_graph`` / ``_in_graph`` with the batch; 0.5.10 calls
  ``init_forward_metadata_capture_cuda_graph`` / ``_replay_cuda_graph`` with loose
  arguments (both outside the graph), mapped here onto the first pair.

A version without the attention-backend registry (``attention_registry``) or the backend
base class is refused by :func:`unsupported_reason`, and ``register()`` leaves it untouched.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import SimpleNamespace
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

#: modules that may hold the attention-backend choices list, newest layout first
_CHOICES_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.server_args")
#: server-args fields that select an attention backend
BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def choices_api() -> Optional[Tuple[list, object]]:
    """``(ATTENTION_BACKEND_CHOICES, add_attention_backend_choices)`` of this SGLang, or
    None when no known module holds them."""
    for name in _CHOICES_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        choices = getattr(module, "ATTENTION_BACKEND_CHOICES", None)
        add = getattr(module, "add_attention_backend_choices", None)
        if isinstance(choices, list) and callable(add):
            return choices, add
    return None


def registry_api() -> Optional[Tuple[dict, object]]:
    """``(ATTENTION_BACKENDS, register_attention_backend)``, or None when absent."""
    try:
        from sglang.srt.layers.attention.attention_registry import (
            ATTENTION_BACKENDS,
            register_attention_backend,
        )
    except ImportError:
        return None
    return ATTENTION_BACKENDS, register_attention_backend


def has_plugin_loader() -> bool:
    """True when SGLang loads ``sglang.srt.plugins`` entry points in its processes."""
    try:
        from sglang.srt.plugins import load_plugins  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported_reason() -> Optional[str]:
    """Why this SGLang cannot take the backend (None when it can): every extension point
    the integration needs must be there before anything is changed."""
    if choices_api() is None:
        return "no ATTENTION_BACKEND_CHOICES / add_attention_backend_choices"
    if registry_api() is None:
        return "no layers.attention.attention_registry.register_attention_backend"
    for module in ("sglang.srt.layers.attention.base_attn_backend",
                   "sglang.srt.mem_cache.memory_pool", "sglang.srt.layers.radix_attention"):
        if importlib.util.find_spec(module) is None:  # located, not imported (cheap)
            return f"no {module}"
    if not has_plugin_loader() and _engine_class() is None:
        return "no plugin loader and no Engine.run_scheduler_process_func to reach the " \
               "scheduler processes"
    return None


# ---------------------------------------------------------------------- spawn hook (0.5.10)

def _engine_class():
    try:
        from sglang.srt.entrypoints.engine import Engine
    except ImportError:
        return None
    return Engine if hasattr(Engine, "run_scheduler_process_func") else None


def selects_hygon(server_args, name: str) -> bool:
    return any(getattr(server_args, f, None) == name for f in BACKEND_FIELDS)


def run_scheduler_process(server_args, *args, **kwargs):
    """SGLang's ``run_scheduler_process`` in a spawned scheduler process, after
    registering ``hygon`` there when ``server_args`` select it (SGLang without a plugin
    loader). Picklable by reference: the child imports this module."""
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    from hygon_attn_backend.integrations.sglang import BACKEND_NAME, register

    if selects_hygon(server_args, BACKEND_NAME):
        register()
    return sglang_run(server_args, *args, **kwargs)


def install_spawn_hook() -> bool:
    """Point ``Engine.run_scheduler_process_func`` at :func:`run_scheduler_process` when
    it still names SGLang's own function (an application's own override is kept).
    Returns True when the hook is in place."""
    engine = _engine_class()
    if engine is None:
        return False
    current = engine.__dict__.get("run_scheduler_process_func")
    func = current.__func__ if isinstance(current, staticmethod) else current
    if func is run_scheduler_process:
        return True
    if getattr(func, "__module__", "") != "sglang.srt.managers.scheduler":
        logger.warning("hygon: Engine.run_scheduler_process_func is %r (not SGLang's): left "
                       "as it is; its processes must call register() themselves", func)
        return False
    engine.run_scheduler_process_func = staticmethod(run_scheduler_process)
    return True


# ---------------------------------------------------------------------- backend adapters

def write_loc(forward_batch, layer):
    """What this SGLang's ``set_kv_buffer`` takes as the write location of ``layer``'s
    new tokens in ``forward_batch``."""
    try:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    except ImportError:  # 0.5.10: the bare out_cache_loc
        return forward_batch.out_cache_loc
    if hasattr(KVWriteLoc, "for_layer"):  # 0.5.23
        return KVWriteLoc.for_layer(forward_batch, layer)
    return KVWriteLoc(forward_batch.out_cache_loc)  # 0.5.17


def has_legacy_graph_hooks(attention_backend: type) -> bool:
    """Whether SGLang's backend base ``attention_backend`` has the older CUDA-graph hooks
    only (0.5.10: no ``init_forward_metadata_out_graph``)."""
    return not hasattr(attention_backend, "init_forward_metadata_out_graph")


def backend_bases(attention_backend: type) -> tuple:
    """The bases of our backend class: SGLang's ``AttentionBackend``, behind
    :class:`LegacyGraphHooks` where that base has the older hooks only (0.5.10)."""
    if not has_legacy_graph_hooks(attention_backend):
        return (attention_backend,)
    return (LegacyGraphHooks, attention_backend)


class LegacyGraphHooks:
    """SGLang 0.5.10's CUDA-graph hooks on top of ``init_forward_metadata_out_graph`` /
    ``_in_graph``. The runner calls both outside the captured graph, so the static
    buffers are filled eagerly before capture and before each replay; the graph reads
    them, as the newer flow's recorded refill does."""

    @staticmethod
    def _batch(bs, req_pool_indices, seq_lens, forward_mode, spec_info, seq_lens_cpu=None):
        return SimpleNamespace(batch_size=bs, req_pool_indices=req_pool_indices,
                               seq_lens=seq_lens, forward_mode=forward_mode,
                               spec_info=spec_info, seq_lens_cpu=seq_lens_cpu)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode,
                                                 spec_info):
        del num_tokens
        if encoder_lens is not None:
            raise NotImplementedError("hygon attention backend: encoder-decoder CUDA graphs "
                                      "are not supported")
        batch = self._batch(bs, req_pool_indices, seq_lens, forward_mode, spec_info)
        self.init_forward_metadata_out_graph(batch, in_capture=True)
        self.init_forward_metadata_in_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum, encoder_lens, forward_mode,
                                                spec_info, seq_lens_cpu=None):
        del seq_lens_sum, encoder_lens
        batch = self._batch(bs, req_pool_indices, seq_lens, forward_mode, spec_info,
                            seq_lens_cpu)
        self.init_forward_metadata_out_graph(batch, in_capture=False)
        self.init_forward_metadata_in_graph(batch)
