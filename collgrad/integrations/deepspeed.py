"""DeepSpeed's six full accessors served by collgrad: ``install()`` makes the loops users already have,

    for name, p in engine.module.named_parameters():
        g = deepspeed.utils.safe_get_full_grad(p)              # one collective per parameter
        w = deepspeed.utils.safe_get_full_fp32_param(p)
        m = deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg")

cost one collective per bucket. The first call of a kind (gradients, fp32 weights, one optimizer state)
gathers, with collgrad's model-wide read, a window of the parameters that follow in
``named_parameters()`` order (about ``window_bytes``); the next calls are answered from it, each value
handed over once. A window is dropped when its engine runs ``backward()``, ``step()`` or
``load_checkpoint()``, a setter of its kind writes, or one of collgrad's model-wide setters does
(``safe_set_full_model_*``, ``safe_update_full_model_grads``), so reads see new values; memory held is one
window per kind at a time.

DeepSpeed's semantics: the same values (bitwise: collgrad's reads are), dtype, shape and device; a
gradient as DeepSpeed holds it (``p.grad`` where it is set; fp16 gradients scaled, as its accessor
returns them); ``None`` for a frozen parameter. The calling rules too: every rank, the same order. Where
DeepSpeed would hang or return garbage (ranks calling for different parameters, a read before backward
or mid-accumulation) collgrad raises on every rank instead. Setters write this rank's part locally (no
collective, no check between ranks, as DeepSpeed's do); an fp32 weight written also becomes the
module's weight at once, where DeepSpeed's setter leaves the old one to the next forward. Calls
collgrad cannot serve (an optimizer whose layout it does not know, a parameter no engine holds) go to
DeepSpeed's original, said once in the log per reason.

Which names are replaced: the six in ``deepspeed.utils`` and ``deepspeed.utils.tensor_fragment``, and
the same functions wherever a loaded module holds them (found by identity: ``from deepspeed.utils
import safe_get_full_grad`` binds the function itself). A module imported after ``install()`` that
imports them from ``deepspeed.utils`` gets collgrad's. collgrad's own modules keep DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from collgrad import _compat
from collgrad.core.dispatch import default_dispatcher
from collgrad.errors import InvalidArgumentError
from collgrad.state.kinds import FP32, GRAD, Grad, OptimizerState, StateKind
from collgrad.state.read import FullState
from collgrad.state.record import StateRecord

__all__ = ["install", "uninstall", "installed", "ACCESSORS", "DEFAULT_WINDOW_BYTES"]

log = logging.getLogger("collgrad.dropin")

ACCESSORS = (
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_full_fp32_param",
    "safe_set_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
)
#: A window of about one of collgrad's default buckets.
DEFAULT_WINDOW_BYTES = 25 << 20
#: The engine's methods after which a window no longer holds the values (watched once it is seen).
WATCHED = ("backward", "step", "load_checkpoint")


@dataclass
class _Engine:
    """What is kept per engine: its trainable parameters in order, windows per kind, and the epoch
    (backward and step calls seen; writes per kind)."""

    names: list[str]
    index: dict[str, int]
    nbytes: list[int]
    epoch: int = 0
    written: dict[StateKind, int] = field(default_factory=dict)
    known: dict[StateKind, bool] = field(default_factory=dict)  # per kind: collgrad knows the layout
    #: per kind: the epoch it was read at (engine calls, this kind's writes, model-wide writes), values
    windows: dict[StateKind, tuple[tuple[int, int, int], dict[str, torch.Tensor]]] = field(default_factory=dict)


class _Served:
    """The installed drop-in: DeepSpeed's originals, what was replaced, and the engines seen."""

    def __init__(self, originals: dict[str, Callable[..., Any]], window_bytes: int) -> None:
        self.originals = originals
        self.window_bytes = window_bytes
        self.replaced: list[tuple[Any, str, Any]] = []  # (module, name, what it held)
        self.engines: weakref.WeakKeyDictionary[Any, _Engine] = weakref.WeakKeyDictionary()
        # id(param) -> (engine, param, name); the engine is a framework object
        self.owners: dict[int, tuple[weakref.ref[Any], weakref.ref[torch.nn.Parameter], str]] = {}
        self.told: set[str] = set()
        self.watched: list[tuple[weakref.ref[Any], str, Any, Any]] = []  # (engine, method, ours, what it had)
        #: what each window's read did, in order
        self.records: list[StateRecord] = []
        #: collectives and bytes this rank sent through the served calls: windows, DeepSpeed's originals
        self.sent = [0, 0]
        #: the functions installed in DeepSpeed's place, by name
        self.functions: dict[str, Callable[..., Any]] = {}
        #: uninstalled: references kept to the functions call DeepSpeed's originals
        self.closed = False

    def get(self, kind: StateKind, param: Any, fallback: Callable[[], Any]) -> Any:
        if self.closed:  # a reference kept past uninstall(): DeepSpeed's own
            return fallback()
        from collgrad.state.adapters import deepspeed as ds_adapter

        # DeepSpeed's order of answers: BF16_Optimizer's accumulation, a gradient the parameter holds
        # itself, then ZeRO's partitions; else None
        if kind == GRAD and ds_adapter.own_grad(param) is not None:
            return param.grad
        if not param.requires_grad or not ds_adapter.zero_managed(param):
            return None
        found = self._owner(param)
        if found is None:
            return self._fallback("no engine passed to install() holds this parameter", fallback)
        engine, name = found
        state = self.engines[engine]
        from collgrad.state.model_cache import MODELS

        epoch = (state.epoch, state.written.get(kind, 0), MODELS.writes(engine))  # collgrad's model-wide setters too
        held = state.windows.get(kind)
        if held is None or held[0] != epoch or name not in held[1]:
            values = self._gather(engine, state, kind, name)
            if values is None:  # DeepSpeed's accessor: one collective of the whole parameter (ZeRO-1/2) or share
                from collgrad.state.call import source_of
                from collgrad.state.execute import accessor_bytes

                source = source_of(engine, kind, dispatcher=default_dispatcher())[0]
                self.sent[0] += 1
                self.sent[1] += accessor_bytes(source, source.layout.groups[0], ds_adapter.full_numel(param))
                return self._fallback(f"collgrad does not know {type(engine.optimizer).__name__}'s layout", fallback)
            held = state.windows[kind] = (epoch, values)
        return held[1].pop(name)

    def set(self, kind: StateKind, param: Any, value: torch.Tensor, fallback: Callable[[], Any]) -> None:
        if self.closed:
            fallback()
            return
        from collgrad.state.adapters import deepspeed as ds_adapter

        if kind == GRAD and param.grad is not None:
            param.grad.copy_(value)  # as DeepSpeed's setter does
            return
        if not param.requires_grad or not ds_adapter.zero_managed(param):
            return  # DeepSpeed's setters leave such a parameter alone
        found = self._owner(param)
        if found is None:
            self._fallback("no engine passed to install() holds this parameter", fallback)
            return
        engine, name = found
        state = self.engines[engine]
        from collgrad.state.write import write_here

        if not write_here(engine, kind, {name: value}, dispatcher=default_dispatcher()):
            self._fallback(f"collgrad does not know {type(engine.optimizer).__name__}'s layout", fallback)
        state.written[kind] = state.written.get(kind, 0) + 1

    def _gather(self, engine: Any, state: _Engine, kind: StateKind, start: str) -> dict[str, torch.Tensor] | None:
        """The window of ``kind`` from ``start`` on, read by collgrad (collective); None where collgrad
        would only call DeepSpeed's accessor itself (a layout it does not know)."""
        import collgrad
        from collgrad.state.call import source_of

        if kind not in state.known:  # whether collgrad reads this kind itself, or only through DeepSpeed's accessor
            state.known[kind] = source_of(engine, kind, dispatcher=default_dispatcher())[0].accessor is None
        if not state.known[kind]:
            return None
        first = state.index[start]
        last, size = first, 0
        while last < len(state.names) and (last == first or size + state.nbytes[last] <= self.window_bytes):
            size += state.nbytes[last]
            last += 1
        names = state.names[first:last]
        if isinstance(kind, Grad):
            read: FullState = collgrad.safe_get_full_model_grads(engine, params=names, unscale=False)
        elif isinstance(kind, OptimizerState):
            read = collgrad.safe_get_full_model_optimizer_states(engine, kind.key, params=names)
        else:
            read = collgrad.safe_get_full_model_fp32_params(engine, params=names)
        self.records.append(read.record)
        self.sent[0] += read.record.collectives
        self.sent[1] += read.record.bytes
        # Each window's selection keeps a source of its own (its plans are reused every step); its
        # scratch (ZeRO-3's staging) goes with the window, so what is held stays one window per kind.
        source_of(engine, kind, params=names, dispatcher=default_dispatcher())[0].release()
        return dict(read)

    def _owner(self, param: Any) -> tuple[Any, str] | None:
        """The engine holding ``param`` (one of those served) and its name there."""
        hit = self.owners.get(id(param))
        engine = hit[0]() if hit is not None and hit[1]() is param else None
        return None if engine is None or hit is None else (engine, hit[2])

    def adopt(self, engine: Any) -> None:
        """Serve ``engine``'s parameters (once per engine)."""
        if engine not in self.engines:
            _adopt(self, engine)

    def _fallback(self, why: str, fallback: Callable[[], Any]) -> Any:
        if why not in self.told:
            self.told.add(why)
            log.warning(
                "rank %s: collgrad drop-in: %s; DeepSpeed's own accessor serves these calls", _compat.rank(), why
            )
        return fallback()

    def forget_engines(self) -> None:
        """Every engine's methods as they were before it was watched (where nothing replaced ours since)."""
        for ref, method, ours, before in reversed(self.watched):
            engine = ref()
            if engine is None or engine.__dict__.get(method) is not ours:
                continue
            if before is None:
                del engine.__dict__[method]
            else:
                engine.__dict__[method] = before
        self.watched.clear()
        self.engines.clear()
        self.owners.clear()


def _adopt(served: _Served, engine: Any) -> None:
    """Learn ``engine``'s parameters, and watch the methods after which a window is stale (WATCHED)."""
    from collgrad.state.adapters import deepspeed as ds_adapter

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    sizes = [ds_adapter.full_numel(p) * 4 for _, p in named]
    state = served.engines[engine] = _Engine([n for n, _ in named], {n: i for i, (n, _) in enumerate(named)}, sizes)
    ref = weakref.ref(engine)
    for n, p in named:
        served.owners[id(p)] = (ref, weakref.ref(p), n)
    for method in WATCHED:
        real, before = getattr(engine, method), engine.__dict__.get(method)

        def watched(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            state.epoch += 1
            try:
                return _real(*args, **kwargs)
            finally:
                state.epoch += 1
                state.windows.clear()

        setattr(engine, method, watched)
        served.watched.append((ref, method, watched, before))


def _replacements(served: _Served) -> dict[str, Callable[..., Any]]:
    o = served.originals

    def safe_get_full_grad(param: Any) -> Any:
        return served.get(GRAD, param, lambda: o["safe_get_full_grad"](param))

    def safe_set_full_grad(param: Any, value: torch.Tensor) -> None:
        served.set(GRAD, param, value, lambda: o["safe_set_full_grad"](param, value))

    def safe_get_full_fp32_param(param: Any) -> Any:
        return served.get(FP32, param, lambda: o["safe_get_full_fp32_param"](param))

    def safe_set_full_fp32_param(param: Any, value: torch.Tensor) -> None:
        served.set(FP32, param, value, lambda: o["safe_set_full_fp32_param"](param, value))

    def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> Any:
        fallback = lambda: o["safe_get_full_optimizer_state"](param, optim_state_key)  # noqa: E731
        return served.get(OptimizerState(optim_state_key), param, fallback)

    def safe_set_full_optimizer_state(param: Any, value: torch.Tensor, optim_state_key: str) -> None:
        fallback = lambda: o["safe_set_full_optimizer_state"](param, value, optim_state_key)  # noqa: E731
        served.set(OptimizerState(optim_state_key), param, value, fallback)

    made = dict(locals())
    out = {name: made[name] for name in ACCESSORS}
    for name, fn in out.items():
        fn.served = served  # how install() and uninstall() find what is installed
        fn.__module__ = __name__
        fn.__doc__ = f"``deepspeed.utils.{name}``, served by collgrad (collgrad.integrations.deepspeed)."
    return out


def install(*engines: Any, window_bytes: int = DEFAULT_WINDOW_BYTES) -> _Served:
    """Serve DeepSpeed's six full accessors with collgrad for the parameters of ``engines`` (see the
    module's docstring) until ``uninstall()``; parameters of any other engine go to DeepSpeed's own.
    Local: call it on every rank with the same engines (calls made through the accessors stay
    collective). Installing again adds engines and changes the window. Returns what is installed:
    ``.functions`` (by name), ``.records`` (what each window's read did) and ``.sent`` (collectives
    and bytes sent)."""
    if not isinstance(window_bytes, int) or window_bytes < 1:
        raise InvalidArgumentError(f"rank {_compat.rank()}: window_bytes must be a positive int, got {window_bytes!r}")
    from collgrad.state.adapters import deepspeed as ds_adapter  # DeepSpeed loaded through the adapter

    found = [ds_adapter.find_engine(e) for e in engines]
    if any(f is None for f in found):
        wrong = next(type(e).__name__ for e, f in zip(engines, found) if f is None)
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: install() takes the DeepSpeed engines to serve (or the modules they wrap), "
            f"got a {wrong}"
        )
    fragment = ds_adapter.accessor_module()
    served = _installed(fragment)
    if served is None:
        originals = {name: getattr(fragment, name) for name in ACCESSORS}
        served = _Served(originals, window_bytes)
        new = served.functions = _replacements(served)
        for module in list(sys.modules.values()):
            if module is None or getattr(module, "__name__", "").startswith("collgrad"):
                continue
            for name in ACCESSORS:
                if getattr(module, name, None) is originals[name]:
                    served.replaced.append((module, name, originals[name]))
                    setattr(module, name, new[name])
    served.window_bytes = window_bytes
    for engine in found:
        served.adopt(engine)
    return served


def uninstall() -> None:
    """DeepSpeed's originals back where ``install()`` found them; engines unwatched. Local."""
    import collgrad.state.adapters.deepspeed as ds_adapter

    served = _installed(ds_adapter.accessor_module())
    if served is None:
        return
    served.closed = True
    for module, name, original in served.replaced:
        setattr(module, name, original)
    served.forget_engines()


def _installed(fragment: types.ModuleType) -> _Served | None:
    """What is installed, found on the function installed in DeepSpeed's place (the installation is the
    only record of itself: nothing of it is kept in this module)."""
    served = getattr(getattr(fragment, ACCESSORS[0], None), "served", None)
    return served if isinstance(served, _Served) and not served.closed else None


@contextlib.contextmanager
def installed(*engines: Any, window_bytes: int = DEFAULT_WINDOW_BYTES) -> Iterator[_Served]:
    """``install(*engines)`` for the block, ``uninstall()`` after it. Yields what is installed (see install)."""
    served = install(*engines, window_bytes=window_bytes)
    try:
        yield served
    finally:
        uninstall()
