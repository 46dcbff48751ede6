"""``async_save_training_state``: a training-state save that returns once each rank's part is copied
aside, its writing and commit going on in a thread of the rank's own while training goes on.

call (every rank)   a pending save waited for first (its failure raised here if never waited for)
                    training.begin_save: the checks and two agreements of the synchronous save
                    this rank's write items' values copied to host memory kept from save to save
                    (storage.Staging): the state at the call, whatever steps follow
thread              storage.write from that copy, flush, hash file; training.end_save: agreed, then
                    committed by rank 0, the manifest last, as the synchronous save commits
                    (agreements over a Gloo group of the model's ranks made once for this: never the
                    training's communicator, never beside its collectives)

The checkpoint is the synchronous save's, byte for byte in layout; a kill at any moment leaves the
previous checkpoint or the new one (the manifest is renamed into place last). Saves that need the
training's group to move state (ranks that do not share the directory, kinds read only through
DeepSpeed's accessors) are refused: ``save_training_state`` writes those.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.checkpoint import storage
from collgrad.checkpoint.agree import Phases
from collgrad.checkpoint.save import DEFAULT_MAX_SHARD_BYTES
from collgrad.checkpoint.training import Save, SavedTrainingState, begin_save, end_save, save_phases
from collgrad.core.dispatch import Dispatcher
from collgrad.errors import CollgradTimeoutError
from collgrad.state import adapters
from collgrad.state.model_cache import Context

__all__ = ["async_save_training_state", "PendingSave"]


class PendingSave:
    """An async save under way on this rank (``async_save_training_state``'s handle)."""

    def __init__(self, directory: str, me: int) -> None:
        self.directory = directory
        self._me = me
        self._result: SavedTrainingState | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.waited = False

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed: ``wait()`` says which). Local."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SavedTrainingState:
        """What ``save_training_state`` returns, once the checkpoint is committed; its failure on any rank
        raised on every rank (the one that failed raises its own error, the others RankFailedError naming
        it: the background's agreements told them). CollgradTimeoutError where ``timeout`` seconds pass
        first (the save goes on: wait again). Local: each rank waits for its own thread."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CollgradTimeoutError(
                    f"rank {self._me}: the async save to {self.directory} did not finish within {timeout} s; it "
                    "goes on: call wait() again"
                )
        self.waited = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _run(self, save: Save, staged: storage.ValuesOf, writer: storage.Writer, phases: Phases, start: float) -> None:
        try:
            save.write(writer, staged, phases)  # the small pieces exchanged over the background's group
            self._result = end_save(save, writer, phases, start)
        except BaseException as error:  # noqa: BLE001 - raised by wait() on this rank, never lost
            self._error = error


#: The one async save of this process at a time, the host memory its copy reuses from save to save, and
#: the groups its background agreements run over (by the model's ranks; made once).
_pending: PendingSave | None = None
_staging = storage.Staging()
_groups: dict[tuple[int, ...], ProcessGroup] = {}


def _settle() -> None:
    """The pending save waited for: its failure raised here if nobody waited for it. Local."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None and not pending.waited:  # once waited for, it has finished and told its outcome
        pending.wait()


def _background_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """A Gloo group of ``group``'s ranks for the background's agreements, made the first time (only its
    own ranks take part: ``use_local_synchronization``). Gloo: it carries small CPU tensors beside any
    backend the training runs, on a communicator of its own. Collective over ``group`` the first time."""
    if group is None:
        return None
    ranks = tuple(_compat.group_ranks(group))
    found = _groups.get(ranks)
    if found is None:
        found = _groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return found


def _kept(value: Any) -> Any:
    """An optimizer's state that is not per element (a step count: a tensor Adam adds to in place, or a
    number), as it is now."""
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _needs(save: Save) -> str | None:
    """What an async save needs that ``save`` lacks: the same on every rank (agreed, or of the same
    optimizer)."""
    if not save.shared:
        return (
            f"async_save_training_state needs every rank to see the directory {save.path} (a shared file system): "
            "use save_training_state, which streams the state to rank 0"
        )
    if any(one.source.accessor is not None for one in save.held.sources):
        return (
            "async_save_training_state copies the state from where collgrad reads it in place, which DeepSpeed's "
            "BF16_Optimizer and NVMe offload do not keep: use save_training_state"
        )
    return None


def async_save_training_state(
    model: object,
    directory: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dispatcher: Dispatcher | None = None,
) -> PendingSave:
    """``save_training_state``, returning once this rank's part of the state is copied aside (to host
    memory kept from one call to the next): the writing, the flush and the commit go on in a thread of
    this rank's own, and the checkpoint holds the state at the call, whatever steps follow. The same
    arguments, checks and files as ``save_training_state``, and the same guarantee: a failure or a kill
    at any moment leaves the previous checkpoint in ``directory`` or the new one, whole.

    Returns a ``PendingSave``: ``wait(timeout=None)`` gives the ``SavedTrainingState`` (or raises the
    save's failure on every rank), ``done()`` says whether it finished. A call while a save is pending
    waits for it first, and raises its failure if nobody waited for it. The background's agreements
    run over a Gloo group of the model's ranks made at the first call, never the training's. Refused
    (InvalidArgumentError on every rank, nothing written) where the ranks do not share ``directory``
    or DeepSpeed's BF16_Optimizer or NVMe offload hold the state: ``save_training_state`` saves those.

    When and where: on every rank of the model's data-parallel group (every shard's under tensor or
    expert parallelism), with the same arguments, outside ``forward()``/``step()``. ``wait()`` before
    loading from ``directory`` and before destroying the process group.
    """
    _settle()
    start = time.perf_counter()
    ctx = Context.of(dispatcher)
    entrance = adapters.enter(model)
    phases = save_phases(ctx, entrance, "async_save_training_state")
    path = os.fspath(directory)
    save = begin_save(ctx, entrance, phases, path, optimizer, lr_scheduler, max_shard_bytes, _needs)
    # what the manifest holds that the training changes in place (step tensors, the scheduler's lists), as now
    manifest = save.manifest
    states = {name: {k: _kept(v) for k, v in held.items()} for name, held in manifest.param_states.items()}
    groups = tuple(
        replace(g, hyperparameters={k: _kept(v) for k, v in g.hyperparameters.items()}) for g in manifest.param_groups
    )
    scheduler = copy.deepcopy(manifest.lr_scheduler)
    save.manifest = replace(manifest, param_groups=groups, param_states=states, lr_scheduler=scheduler)
    staged = _staging.copy(save.staged_items(), storage.in_memory(save.memory))
    background = phases._replace(group=_background_group(phases.group))
    global _pending
    pending = _pending = PendingSave(path, entrance.me)
    # not a daemon: a rank that exits first waits for its save to finish (each of its waits is bounded)
    thread = threading.Thread(
        target=pending._run,
        args=(save, staged, save.writer(), background, start),
        name=f"collgrad-async-save-{entrance.me}",
    )
    pending._thread = thread
    thread.start()
    return pending
