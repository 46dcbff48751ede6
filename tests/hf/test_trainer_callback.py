"""GradStatsCallback in a Transformers Trainer on 2 CPU ranks (a tiny GPT-2 built from a config), with
DeepSpeed ZeRO-2 and without it (DDP over Gloo): per-module gradient norms, the global norm and the
non-finite count reach the logs at every logging step, equal to the norms of the full gradients at
that step and, at the first step, to those of plain PyTorch on the batches the ranks saw (and under
DeepSpeed to the norm it clips with); the run's parameters are bitwise those of
the same run without the callback."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'collgrad[hf]')")

import torch

from tests.harness import run_ranks
from tests.tolerance import norm_of_sum_of_squares

STEPS = 3


def _train(rank: int, with_callback: bool, deepspeed: bool = True) -> tuple[list[dict], list[dict], dict]:
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")  # unused: the process group already exists
    from transformers import Trainer, TrainingArguments

    import collgrad
    from collgrad.integrations.transformers import GradStatsCallback
    from tests.deepspeed import models

    model = _model()
    batches: list[list[list[int]]] = []  # what this rank's model saw, for the plain PyTorch reference
    model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].tolist()), with_kwargs=True)
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(16):
        ids = torch.randint(0, 64, (8,), generator=gen)
        data.append({"input_ids": ids, "labels": ids})
    cfg = models.config(2)
    cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
    args = TrainingArguments(
        output_dir=f"/tmp/collgrad-trainer-{rank}",
        per_device_train_batch_size=2,
        max_steps=STEPS,
        logging_steps=1,
        deepspeed=cfg if deepspeed else None,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    full_norms: list[dict] = []
    if with_callback:
        GradStatsCallback.attach(trainer)

        def read(engine):  # the full gradients themselves, at the same moment
            if deepspeed:
                grads = collgrad.safe_get_full_model_grads(engine)
            else:  # DDP: .grad holds the reduced gradients; read them as they are
                grads = {n: p.grad for n, p in engine.named_parameters() if p.grad is not None}
            per_module: dict[str, float] = {}
            for n, g in grads.items():
                m = n.rpartition(".")[0]
                per_module[m] = per_module.get(m, 0.0) + float(g.double().square().sum())
            full_norms.append({m: math.sqrt(v) for m, v in per_module.items()})

        trainer.add_callback(_ReadAtStart(read) if deepspeed else _ReadBeforeStep(read))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return logs, full_norms, params, batches


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # deterministic: comparable with plain
    return GPT2LMHeadModel(config)


def _plain_first_step_norms(first_batches: list[list[list[int]]], clip: bool) -> tuple[dict[str, float], dict]:
    """Plain PyTorch: per-module norms of the first step's gradient of the whole batch (every rank's),
    normalized as the Trainer does: the summed token loss over the number of labels of all ranks; and
    per module how far (relative) the ranks' may be. First order (tests/tolerance.py): each rank's
    gradient is the same on both sides, their sum is taken in another order and scaled (the world is
    2: exact), so each element is within reordered_sum(ranks + 1) of their magnitudes' sum M; the
    module norm then within ||M|| / ||G|| and its own fp32 rounding; clipping adds the relative error
    of its coefficient (the same, over the whole model)."""
    from tests.tolerance import norm_of_sum_of_squares, reordered_sum

    model = _model()
    labels = sum(torch.tensor(batch).numel() for batch in first_batches)
    magnitude = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for batch in first_batches:
        before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        ids = torch.tensor(batch)
        model(input_ids=ids, labels=ids, num_items_in_batch=labels).loss.backward()
        for n, p in model.named_parameters():  # this rank's term (what the backward added)
            magnitude[n] += (p.grad.double() - before[n].double()).abs()
    slack = reordered_sum(len(first_batches) + 1, torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    whole = math.sqrt(sum(float(((slack * m) ** 2).sum()) for m in magnitude.values()))
    total = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    clipped = clip and total > 1.0  # the Trainer's max_grad_norm
    if clip:  # the Trainer's own clipping (max_grad_norm=1.0), which runs before on_pre_optimizer_step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    per_module: dict[str, float] = {}
    spread: dict[str, float] = {}
    for n, p in model.named_parameters():
        m = n.rpartition(".")[0]
        per_module[m] = per_module.get(m, 0.0) + float(p.grad.double().square().sum())
        spread[m] = spread.get(m, 0.0) + float(((slack * magnitude[n]) ** 2).sum())
    norms = {m: math.sqrt(v) for m, v in per_module.items()}
    scale = 1.0 if not clipped else 1.0 / total  # the modules' norms as clipped
    bounds = {
        m: math.sqrt(spread[m]) * scale / max(norms[m], 1e-30)
        + norm_of_sum_of_squares(numel, torch.float32)
        + ((whole / total + norm_of_sum_of_squares(numel, torch.float32)) if clipped else 0.0)
        for m in norms
    }
    return norms, bounds


class _ReadAtStart:
    """Registers ``fn`` as a pre-step hook once training has built the engine."""

    def __new__(cls, fn):
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                import collgrad

                collgrad.register_pre_step_hook(model, fn)

        return Callback()


def _ReadBeforeStep(fn):  # noqa: N802 - a class, made where transformers is imported
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            fn(model)

    return Callback()


def _worker(rank, world, deepspeed):
    logs, full_norms, params, batches = _train(rank, True, deepspeed)
    _, _, plain_params, _ = _train(rank, False, deepspeed)
    return {
        "logs": logs,
        "first_batch": batches[0],
        "full_norms": full_norms,
        "bitwise": all(torch.equal(params[n], plain_params[n]) for n in params),
    }


@pytest.fixture(scope="module", params=["deepspeed", "ddp"])
def results(request):
    return request.param, run_ranks(_worker, 2, request.param == "deepspeed", timeout=600)


def test_per_module_norms_reach_the_logs_at_every_logging_step(results):
    how, results = results
    # collgrad's norms (fp32 fragment norms) against fp64 norms of the same gradients, and two fp32 sums
    # of the same squares (DeepSpeed's clipping norm): within norm_of_sum_of_squares of the model's
    # element count (tests/tolerance.py)
    bound = norm_of_sum_of_squares(sum(p.numel() for p in _model().parameters()), torch.float32)
    for res in results:
        assert len(res["logs"]) == STEPS == len(res["full_norms"])
        for log, full in zip(res["logs"], res["full_norms"]):
            for module, norm in full.items():
                assert abs(log[f"grad_norm/{module}"] - norm) <= bound * max(norm, 1e-12), module
            assert log["grad_nonfinite"] == 0
            total = math.sqrt(sum(n * n for n in full.values()))
            assert abs(log["grad_norm/global"] - total) <= bound * total
            if how == "deepspeed":  # the global norm is the one DeepSpeed clips with (logged as grad_norm)
                assert abs(log["grad_norm/global"] - log["grad_norm"]) <= 2 * bound * log["grad_norm"]
    assert results[0]["logs"] == results[1]["logs"]  # the same numbers on every rank
    plain, bounds = _plain_first_step_norms([res["first_batch"] for res in results], clip=how == "ddp")
    first = results[0]["logs"][0]
    for module, norm in plain.items():
        assert abs(first[f"grad_norm/{module}"] - norm) <= bounds[module] * norm, (
            how,
            module,
            first[f"grad_norm/{module}"],
            norm,
            bounds[module],
        )


def test_the_callback_changes_nothing_in_training(results):
    _, results = results
    for res in results:
        assert res["bitwise"]
