"""Launching a Triton kernel whose batch-level arguments were fixed once per step.

An engine calls attention once per layer with the same batch, so a launch's arguments
fall in three groups: the batch's (grid, constexprs, tile config, lengths, scalar options),
fixed when a plan is built, once per step; the layer's (its caches, their strides, its fp8
scales and sinks), read once into a :class:`LayerArgs` that the layer keeps across steps;
and the call's (the query and output tensors and their strides), the only values read per
call. :class:`Launch` takes the first group once and per call a ``LayerArgs`` and the
call's values, in a fixed order.

Triton's own launch path (``kernel[grid](**kwargs)``) binds every argument by name,
specializes each one (16-byte alignment of pointers, ``== 1`` and ``% 16`` of integers)
and builds a cache key string, on every call: with 50-60 arguments that is tens of
microseconds of host time per launch. Here the first call of each argument *signature*
goes through that path (it compiles or finds the kernel and returns it); later calls whose
arguments have the same signature (every tensor's dtype and 16-byte alignment, every
integer's exact value; the layer's part computed once, when its ``LayerArgs`` is built)
call the compiled kernel directly. The signature is
stricter than Triton's specialization, so a direct launch always runs the kernel Triton
would have chosen. Under ``TRITON_INTERPRET=1`` or with launch hooks installed (profilers)
every call takes Triton's path.

A direct launch hands the launcher every pointer as an integer (``data_ptr()``, which the
signature reads anyway). Given a tensor, Triton's C launcher calls its ``data_ptr`` method
and asks the driver whether the address is a device pointer (``cuPointerGetAttribute``:
the "cannot be accessed from Triton (cpu tensor?)" check), once per pointer argument on
every launch; given an integer it takes it as it is (``getPointer`` in
``triton/backends/nvidia/driver.c``). That check already ran on the first call of the
signature, which went through Triton's path with the tensors, and the signature includes
whether each per-layer tensor is on the GPU. A launcher that refuses integers makes the
launch fall back to tensors for good.
"""

from __future__ import annotations

from itertools import count
from operator import attrgetter
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

_DTYPE_AND_DEVICE = attrgetter("dtype", "is_cuda")


def intern_key(key: tuple) -> int:
    """A small int standing for ``key`` (equal keys, equal ints): what a per-call lookup
    hashes instead of a long tuple (CPython does not cache a tuple's hash). Bounded: past
    4096 keys the table starts over and a key seen again gets a new int, which only costs
    a new entry in the tables keyed by it."""
    i = _INTERNED.get(key)
    if i is None:
        if len(_INTERNED) >= 4096:
            _INTERNED.clear()
        i = _INTERNED[key] = next(_INTERN_IDS)
    return i


_INTERNED: Dict[tuple, int] = {}
_INTERN_IDS = count(1)


class LayerArgs:
    """One layer's arguments to a kernel's launches, read once (the layer keeps it across
    steps): its tensors (the placeholders of absent optional pointers included), then its
    scalars, in the order of the launch's ``per_layer`` names.

    Holds the tensors (Triton's path takes them), their addresses as integers (the direct
    path passes these: the tensors live as long as this object), and the interned signature
    of this part of the call (each tensor's 16-byte alignment, dtype and whether it is on
    the GPU, every scalar's value), so a call hashes one int for the whole layer.
    """

    __slots__ = ("values", "ints", "sig")

    def __init__(self, tensors: Sequence = (), scalars: Sequence = ()):
        tensors, scalars = tuple(tensors), tuple(scalars)
        ptrs = tuple(t.data_ptr() for t in tensors)
        self.values = tensors + scalars
        self.ints = ptrs + scalars
        self.sig = intern_key((tuple(p & 15 for p in ptrs),
                               tuple(map(_DTYPE_AND_DEVICE, tensors)), scalars))


#: the layer part of a launch whose arguments are all the batch's or the call's
NO_LAYER = LayerArgs()


class Launch:
    """One kernel launch with fixed grid and batch-level arguments.

    kernel: the ``@triton.jit`` function. grid: ``(x, y, z)`` ints.
    fixed: every argument that is the same for all layers of the step (constexprs
       included), by name. per_layer: the names a :class:`LayerArgs` supplies, in its
       order (tensors first, then scalars). per_call: the names of the remaining
       arguments, in the order :meth:`__call__` takes them after the ``LayerArgs``: the
       tensors first (names ending in ``_ptr``), then the scalars. num_warps, num_stages:
       launch options; launch_pdl: launch as a programmatic dependent launch of the kernel
       before it on the stream (NVIDIA sm_90+; the compiled kernel keeps the flag, so the
       direct path launches it the same way).
    """

    __slots__ = ("kernel", "grid", "_template", "_layer_slots", "_call_slots", "_options",
                 "_compiled", "_num_tensors", "_int_pointers", "_int_template", "_forward")

    def __init__(self, kernel, grid: Tuple[int, int, int], fixed: Dict[str, Any],
                 per_call: Sequence[str], *, per_layer: Sequence[str] = (), num_warps: int,
                 num_stages: int, launch_pdl: bool = False):
        names = list(kernel.arg_names)
        position = {n: i for i, n in enumerate(names)}  # a plan per step builds these:
        given = set(per_call) | set(per_layer)  # no quadratic scans
        missing = [n for n in names if n not in fixed and n not in given]
        unknown = [n for n in [*fixed, *per_layer, *per_call] if n not in position]
        if missing or unknown:
            raise TypeError(f"{getattr(kernel, '__name__', kernel)}: arguments missing "
                            f"{missing}, unknown {unknown}")
        for group in (per_layer, per_call):
            tensors = [n.endswith("_ptr") for n in group]
            if tensors != sorted(tensors, reverse=True):
                raise TypeError(f"per_layer and per_call must list the tensors (*_ptr) "
                                f"first, got {list(group)}")
        self.kernel = kernel
        self.grid = tuple(int(g) for g in grid)
        self._template = [fixed.get(n) for n in names]
        self._layer_slots = tuple(position[n] for n in per_layer)
        self._call_slots = tuple(position[n] for n in per_call)
        self._options = dict(num_warps=num_warps, num_stages=num_stages)
        if launch_pdl:
            self._options["launch_pdl"] = True
        self._compiled: Dict[tuple, Any] = {}
        self._num_tensors = sum(1 for n in per_call if n.endswith("_ptr"))
        self._int_pointers = True
        # the direct path's template: the batch-level tensors (block table, lengths,
        # scratch) as their addresses, read once (they belong to the plan and live as long
        # as it does)
        self._int_template = [v.data_ptr() if hasattr(v, "data_ptr") else v
                              for v in self._template]
        self._forward = _forward_function(self.grid, self._int_template, self._layer_slots,
                                          self._call_slots)

    def signature(self, layer: LayerArgs, values: Sequence,
                  ptrs: Optional[Sequence[int]] = None) -> tuple:
        """What decides the compiled kernel: the layer's interned signature, then each
        call tensor's 16-byte alignment, dtype and whether it is on the GPU, and every call
        scalar's exact value. ``ptrs``: the call tensors' ``data_ptr()`` when the caller
        has them."""
        n = self._num_tensors
        tensors = values[:n]
        if ptrs is None:
            ptrs = [t.data_ptr() for t in tensors]
        return (layer.sig, *[p & 15 for p in ptrs], *map(_DTYPE_AND_DEVICE, tensors),
                *values[n:])

    def __call__(self, layer: LayerArgs, *values) -> None:
        n = self._num_tensors
        tensors = values[:n]
        ptrs = [t.data_ptr() for t in tensors]
        direct = self._compiled.get((layer.sig, *[p & 15 for p in ptrs],
                                     *map(_DTYPE_AND_DEVICE, tensors), *values[n:]))
        if direct is not None and _no_hooks():
            run, function, packed_metadata, device = direct
            if self._int_pointers:
                try:
                    self._forward(run, _stream_of(device), function, packed_metadata,
                                  layer.ints, *ptrs, *values[n:])
                    return
                except (TypeError, ValueError, OverflowError):
                    # this Triton's launcher takes no integer pointers (raised before
                    # anything was launched): pass tensors from now on
                    self._int_pointers = False
            run(*self.grid, _stream_of(device), function, packed_metadata, None, None, None,
                *self._args(layer, values))
            return
        compiled = self.kernel[self.grid](*self._args(layer, values), **self._options)
        if compiled is not None and not _triton_pieces()["interpret"]:
            entry = tuple(getattr(compiled, n, None) for n in ("run", "function",
                                                                "packed_metadata"))
            if None not in entry:  # a Triton whose launcher takes this form
                device = _triton_pieces()["driver"].active.get_current_device()
                self._compiled[self.signature(layer, values, ptrs)] = entry + (device,)

    def _args(self, layer: LayerArgs, values: Sequence) -> list:
        """Every argument in the kernel's order, tensors as tensors."""
        if len(layer.values) != len(self._layer_slots) or \
                len(values) != len(self._call_slots):
            raise TypeError(f"{getattr(self.kernel, '__name__', self.kernel)}: expected "
                            f"{len(self._layer_slots)} layer and {len(self._call_slots)} "
                            f"call arguments, got {len(layer.values)} and {len(values)}")
        args = self._template.copy()
        for i, v in zip(self._layer_slots, layer.values):
            args[i] = v
        for i, v in zip(self._call_slots, values):
            args[i] = v
        return args

    def direct_call(self, layer: LayerArgs, *values):
        """A zero-argument callable making only Triton's launcher call for these
        arguments (every argument list prebuilt), or None before the signature's first call
        has compiled it: what ``bench overhead`` times as the launcher's own cost."""
        n = self._num_tensors
        ptrs = [t.data_ptr() for t in values[:n]]
        direct = self._compiled.get(self.signature(layer, values, ptrs))
        if direct is None or not self._int_pointers:
            return None
        run, function, packed_metadata, device = direct
        args = self._int_template.copy()
        for i, v in zip(self._layer_slots, layer.ints):
            args[i] = v
        for i, v in zip(self._call_slots, [*ptrs, *values[n:]]):
            args[i] = v
        stream = _stream_of(device)
        grid = self.grid
        return lambda: run(*grid, stream, function, packed_metadata, None, None, None, *args)

    @property
    def num_direct_signatures(self) -> int:
        """Argument signatures that launch the compiled kernel directly."""
        return len(self._compiled)


def _forward_function(grid: Tuple[int, int, int], template: list, layer_slots: Sequence[int],
                      call_slots: Sequence[int]):
    """``forward(run, stream, function, packed_metadata, layer_ints, *call_values)``: the
    call Triton's own launcher makes once it has found the kernel (``triton/runtime/jit.py``,
    ``JITFunction.run``, with no launch hooks), every argument in the kernel's order.

    The grid and the batch-level values are bound as closure constants and the layer's
    values are read from its tuple by constant index, so a call builds no argument list:
    it passes its values straight through (the binder Triton generates for
    ``kernel[grid](...)`` works the same way). The binding function is generated once per
    argument layout (a plan built every step reuses it).
    """
    layer_slots, call_slots = tuple(layer_slots), tuple(call_slots)
    layout = (len(template), layer_slots, call_slots)
    bind = _BINDERS.get(layout)
    if bind is None:
        source = {slot: f"L[{i}]" for i, slot in enumerate(layer_slots)}
        source.update({slot: f"a{i}" for i, slot in enumerate(call_slots)})
        fixed = [j for j in range(len(template)) if j not in source]
        params = "".join(f", a{i}" for i in range(len(call_slots)))
        args = ", ".join(source.get(j, f"f{j}") for j in range(len(template)))
        src = (f"def bind(g0, g1, g2{''.join(f', f{j}' for j in fixed)}):\n"
               f"    def forward(run, stream, function, packed_metadata, L{params}):\n"
               f"        run(g0, g1, g2, stream, function, packed_metadata, None, None, None, "
               f"{args})\n"
               f"    return forward\n")
        scope: Dict[str, Any] = {}
        exec(src, scope)  # noqa: S102 (source built above from argument positions only)
        bind = _BINDERS[layout] = scope["bind"]
    given = set(layer_slots) | set(call_slots)
    fixed_values = [v for j, v in enumerate(template) if j not in given]
    return bind(*grid, *fixed_values)


_BINDERS: Dict[tuple, Any] = {}  # (number of arguments, layer slots, call slots) -> bind
_state: Dict[str, Any] = {}


def _triton_pieces():
    """Triton's knobs and driver, and the interpreter flag, read once."""
    if not _state:
        import triton
        from triton.runtime import driver

        from hygon_attn_backend.ops._dispatch import triton_interpreter_on

        _state["knobs"] = getattr(triton, "knobs", None)
        _state["driver"] = driver
        _state["interpret"] = triton_interpreter_on()
    return _state


def _hook_set(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # triton.knobs.HookChain
    return not isinstance(calls, list) or bool(calls)


def _no_hooks() -> bool:
    """No launch hooks installed (a profiler sees every launch through Triton's own path)."""
    knobs = _triton_pieces()["knobs"]
    if knobs is None:
        return False
    runtime = knobs.runtime
    return not (_hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook))


def _stream_of(device):
    """The current stream of ``device`` (the device the kernel was compiled and loaded on)."""
    get = _state.get("get_stream")
    if get is None:
        get = _state["get_stream"] = _triton_pieces()["driver"].active.get_current_stream
    return get(device)


def value_or_id(x):
    """A tensor's identity, any other option's value: part of a layer key."""
    return id(x) if isinstance(x, torch.Tensor) else x


def remember_layer(layers: dict, key: tuple, layer):
    """Keep the layer binding that :meth:`run` built from a call's caches and options,
    keyed by the ``id()`` of each tensor and the value of each other option, so the next
    call of the same layer (an engine's next step, a benchmark's next repeat) skips
    resolving it again. The binding holds every tensor whose id is in its key, so no id
    can be reused by another tensor while it is kept; at most 128 are kept per plan."""
    if len(layers) >= 128:
        layers.clear()
    layers[key] = layer
    return layer
