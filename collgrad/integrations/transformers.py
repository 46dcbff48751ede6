"""Hugging Face Trainer: per-layer gradient norms in the Trainer's logs (so they reach every reporter
configured with ``report_to``), and the trained model saved without consolidating it on one rank::

    trainer = Trainer(model, args, ..., callbacks=[GradStatsCallback()])
    trainer.train()
    save_model(trainer, "out")          # instead of trainer.save_model("out"): from_pretrained loads it

Logged every ``logging_steps`` (with the Trainer's ``loss``): ``grad_norm/<module path>`` per module,
``grad_norm/global`` and ``grad_nonfinite``. Under DeepSpeed they are computed in a pre-step hook
(Trainer's step runs inside ``accelerator.backward``): before DeepSpeed's clipping, as it clips them.
Without DeepSpeed (one process, DDP) they are read from ``.grad`` in ``on_pre_optimizer_step``: after
the Trainer's own clipping (``max_grad_norm``), as the optimizer sees them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from transformers import TrainerCallback

from collgrad.checkpoint.save import SavedModel, save_full_model
from collgrad.errors import InvalidArgumentError
from collgrad.state.hook import PreStepHook, register_pre_step_hook
from collgrad.state.stats import GradStats, safe_get_full_model_grad_stats

__all__ = ["GradStatsCallback", "grad_stats_logs", "save_model", "save_pretrained_files", "load_into_zero3"]

#: The key of the root module's own parameters (its module path is the empty string).
ROOT = "(root)"


def grad_stats_logs(stats: GradStats) -> dict[str, float]:
    """``stats`` (grouped by module) as the Trainer's log entries."""
    logs = {f"grad_norm/{group or ROOT}": s.norm for group, s in stats.groups.items()}
    logs["grad_norm/global"] = stats.global_norm
    logs["grad_nonfinite"] = float(sum(s.nonfinite for s in stats.params.values()))
    return logs


# transformers is not installed where mypy runs (the lint env), so TrainerCallback is Any there;
# unused-ignore: with transformers installed (it ships py.typed) the base is typed and nothing is ignored.
class GradStatsCallback(TrainerCallback):  # type: ignore[misc, unused-ignore]
    """Logs per-module gradient norms, the global norm and the count of non-finite gradient elements
    at every logging step. ``by``: ``"module"`` (default), ``"param"`` or a function name -> group.

    Put it before the reporters: ``Trainer(callbacks=[...])`` places it after those of ``report_to``,
    which then log before it adds its entries; ``GradStatsCallback.attach(trainer)`` puts it first.
    Entries always reach ``trainer.state.log_history``.
    """

    # The Trainer's objects (TrainingArguments, TrainerState, TrainerControl, the trainer and its model)
    # enter untyped (Any): transformers is an optional extra.
    _args: Any

    def __init__(self, by: str | Callable[[str], str] = "module") -> None:
        if not (by in ("module", "param") or callable(by)):
            raise InvalidArgumentError(f"by must be 'module', 'param' or a function name -> group, got {by!r}")
        self.by = by
        self.pending: dict[str, float] | None = None
        self.hook: PreStepHook | None = None
        self._state: Any = None

    @classmethod
    def attach(cls, trainer: Any, **kwargs: str | Callable[[str], str]) -> GradStatsCallback:
        """A new callback, first in ``trainer``'s list (before the reporters)."""
        callback = cls(**kwargs)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def _logs_next_step(self) -> bool:
        """The step about to be taken will be logged (DefaultFlowCallback's rule, one step ahead)."""
        state = self._state
        step: int = state.global_step + 1
        if self._args.logging_first_step and step == 1:
            return True
        strategy: str = self._args.logging_strategy  # an IntervalStrategy, a str enum
        every: int = state.logging_steps
        return strategy == "steps" and every > 0 and step % every == 0

    def _collect(self, model: Any) -> None:
        if self._logs_next_step():
            self.pending = grad_stats_logs(safe_get_full_model_grad_stats(model, by=self.by))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._args, self._state = args, state
        if self.hook is None and model is not None:
            try:
                self.hook = register_pre_step_hook(model, self._collect)
            except InvalidArgumentError:
                self.hook = None  # no DeepSpeed engine: on_pre_optimizer_step reads .grad instead

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.hook is None and model is not None:
            self._collect(model)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.pending is None or logs is None or "loss" not in logs:
            return
        logs.update(self.pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.pending)
        self.pending = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def save_model(trainer: Any, output_dir: str | None = None, **kwargs: Any) -> SavedModel:
    """What ``trainer.save_model(output_dir)`` writes for ``from_pretrained`` (the weights as safetensors
    shards and their index, the model's config and generation config, the processing class, the
    training arguments), the weights through ``collgrad.save_full_model``: under ZeRO-3 or FSDP2 streamed
    bucket by bucket where the Trainer consolidates the whole model on one rank first
    (``_zero3_consolidated_16bit_state_dict``). ``kwargs`` go to ``save_full_model`` (``dtype``,
    ``max_shard_bytes``, ``ranks``, ...).

    When and where: on every rank, after (or between) training steps, as ``trainer.save_model``.
    """
    directory = output_dir if output_dir is not None else trainer.args.output_dir
    engine = getattr(trainer, "deepspeed", None)
    saved = save_full_model(engine if engine is not None else trainer.model, directory, **kwargs)
    # after every collective (a failure here raises on this rank alone, with nothing left to wait for)
    if saved.first_writer:
        save_pretrained_files(trainer.model, directory, getattr(trainer, "processing_class", None))
        torch.save(trainer.args, os.path.join(directory, "training_args.bin"))
    return saved


def save_pretrained_files(module: Any, directory: str, processing_class: Any = None) -> None:
    """Everything ``save_pretrained`` writes but the weights: the config, the generation config of a
    model that generates, and ``processing_class`` (a tokenizer, a processor) if given. Local."""
    os.makedirs(directory, exist_ok=True)
    config = getattr(module, "config", None)
    if config is not None:
        config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    if generation is not None and getattr(module, "can_generate", lambda: False)():
        generation.save_pretrained(directory)
    if processing_class is not None:
        processing_class.save_pretrained(directory)


def load_into_zero3(module: torch.nn.Module, state: dict[str, torch.Tensor], ds_config: dict[str, Any]) -> None:
    """Transformers' own ZeRO-3 loading, what ``from_pretrained`` runs under ``HfDeepSpeedConfig`` once
    rank 0 has read the checkpoint (``state``: rank 0's tensors; the other ranks' may be meta tensors of
    the same shapes): per submodule, its parameters gathered, rank 0's values copied in, partitioned
    again on leaving (a broadcast); buffers broadcast. The benchmark's anchor. Collective."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    keep = HfDeepSpeedConfig(ds_config)  # while it lives, Transformers sees ZeRO-3 enabled
    _load_state_dict_into_zero3_model(module, state)
    del keep
