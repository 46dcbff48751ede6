"""FSDP2 (``fully_shard``) models through the same model-wide API, on CPU ranks over Gloo (2 and 3
ranks; HSDP 2 x 2 on 4): reading is bitwise equal to ``p.grad.full_tensor()`` and close to plain
PyTorch, for evenly and unevenly sharded parameters, tied weights, frozen parameters, a subset, nested
units and a single root unit, mixed precision; one collective per bucket; the sharded parameters and
Adam's states read whole bitwise equal to ``full_tensor()``; statistics equal plain
PyTorch's and identical on every rank; training with an edit written before each step equals plain
PyTorch with the same edit; misuse raises together on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.edits import write_edit
from tests.harness import attempt, run_ranks
from tests.tolerance import norm_of_sum_of_squares, reordered_sum, unit_roundoff

STEPS = 3


class Net(nn.Module):
    """Rows not divisible by 2 or 3 (uneven shards), a parameter with fewer rows than ranks, a frozen
    layer and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 9)
        self.norm = nn.LayerNorm(9)
        self.mid = nn.Linear(9, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.tiny = nn.Linear(8, 1)
        self.out = nn.Linear(8, 5, bias=False)
        self.back = nn.Linear(5, 8, bias=False)
        self.emb = nn.Linear(5, 5, bias=False)
        self.head = nn.Linear(5, 5, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        h = torch.tanh(self.mid(h)) + self.frozen(torch.tanh(self.mid(h)))
        o = self.out(h) * (1 + self.tiny(h))
        return self.head(self.emb(o)) + 0.1 * self.out(self.back(o))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)


def _shard(model: nn.Module, mesh, nested: bool, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    if nested:
        for m in (model.inp, model.mid, model.out):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def _plain_grads(world: int, step: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The mean over ranks of plain PyTorch's local gradients, and per parameter how far (relative
    2-norm) another fp32 mean of them may be: a sum of ``world`` terms in another order and a division
    (the pre- or post-division of FSDP2's reduce-scatter), ``reordered_sum(world + 1)`` times the norm of
    the mean magnitude over the norm of the mean (tests/tolerance.py)."""
    model = Net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}
    magnitude = {n: torch.zeros_like(p) for n, p in named}
    for r in range(world):
        model.zero_grad()
        x, y = _batch(r, step)
        nn.functional.mse_loss(model(x), y).backward()
        for n, p in named:
            total[n] += p.grad
            magnitude[n] += p.grad.abs()
    mean = {n: t / world for n, t in total.items()}
    slack = reordered_sum(world + 1, torch.float32)
    return mean, {n: slack * float(magnitude[n].norm()) / max(float(total[n].norm()), 1e-30) for n in mean}


def edit(name: str, g: torch.Tensor) -> torch.Tensor:
    return g * (3.0 if "weight" in name else 0.25)


def _plain_trained(world: int, edited: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Plain PyTorch trained as the ranks train (the mean of each rank's own gradient), and per
    parameter how far (relative 2-norm) training whose means are summed in another order may end from
    it. First order: SGD with momentum is linear in the gradients, so a mean differing by d_s at step s
    (reordered_sum(world + 1) times the edited mean magnitude, elementwise) moves the momentum buffer
    by b_t = mu b_(t-1) + d_t and the parameters by lr * sum_t b_t; what that changes in later
    gradients is second order and left out. The bound is twice that."""
    model = Net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lr, mu = 0.1, 0.9
    opt = torch.optim.SGD([p for _, p in named], lr=lr, momentum=mu)
    slack = reordered_sum(world + 1, torch.float32)
    buffer = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    moved = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    for step in range(STEPS):
        # each rank's gradient as the ranks compute it (unscaled), their mean as FSDP2 takes it
        total = {n: torch.zeros_like(p) for n, p in named}
        magnitude = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
        for r in range(world):
            opt.zero_grad()
            x, y = _batch(r, step)
            nn.functional.mse_loss(model(x), y).backward()
            for n, p in named:
                total[n] += p.grad
                magnitude[n] += p.grad.double().abs() / world
        for n, p in named:
            p.grad = total[n] / world
        if edited:
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.grad = edit(n, p.grad)
                    magnitude[n] = edit(n, magnitude[n])
        for n, _ in named:
            buffer[n] = mu * buffer[n] + slack * magnitude[n]
            moved[n] += lr * buffer[n]
        opt.step()
    out = {n: p.detach().clone() for n, p in named}
    return out, {n: 2 * float(moved[n].norm()) / max(float(out[n].norm()), 1e-30) for n in out}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _worker(rank: int, world: int, hsdp: bool, root: str):
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import collgrad
    from collgrad.core.dispatch import default_dispatcher
    from tests.counting import as_on_a_network_file_system, count_collectives

    as_on_a_network_file_system()  # the small slices exchanged, as where a call costs ~1 ms
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    plain, plain_bound = _plain_grads(world)
    out: dict = {}
    variants = {"nested": (True, None), "root_only": (False, None)}
    if not hsdp:
        variants["mixed_precision"] = (
            True,
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    for name, (nested, mp) in variants.items():
        model = _shard(Net(), mesh, nested, mp)
        entry = {"before_backward": attempt(lambda model=model: collgrad.safe_get_full_model_grads(model))}
        x, y = _batch(rank, 0)
        nn.functional.mse_loss(model(x).float(), y).backward()
        full = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        grads = collgrad.safe_get_full_model_grads(model)
        with count_collectives() as seen:
            again = collgrad.safe_get_full_model_grads(model)
        # this step's shards are read once: later calls reuse them while FSDP2 holds the same ones
        from collgrad.state.model_cache import MODELS

        source = MODELS.of(default_dispatcher())[model][None]
        held = source._held
        shard = weakref.ref(next(p for p in model.parameters() if p.requires_grad).grad._local_tensor)
        stream = collgrad.iter_full_model_grads(model, bucket_bytes=256)
        streamed = dict(stream)
        subset = [n for n in full][1::2]
        part = collgrad.safe_get_full_model_grads(model, params=subset)
        stats = collgrad.safe_get_full_model_grad_stats(model)
        entry.update(
            held=held is not None and source._held is held,
            names=list(grads),
            expected_names=list(full),
            bitwise=all(torch.equal(grads[n], full[n]) for n in full),
            dtypes={n: str(g.dtype) for n, g in grads.items()},
            plain=max(_rel(grads[n], plain[n]) for n in plain),
            plain_ratio=max(_rel(grads[n], plain[n]) / plain_bound[n] for n in plain),
            again=all(torch.equal(again[n], full[n]) for n in full),
            data_calls=seen.data,
            agreements=seen.agreements,
            buckets=again.record.buckets,
            primitives=sorted({str(bk.primitive) for g in again.record.groups for c in g.calls for bk in c.buckets}),
            groups=[(str(g.plan), g.ranks) for g in again.record.groups],
            streamed=sorted(streamed) == sorted(full) and all(torch.equal(streamed[n], full[n]) for n in full),
            stream_buckets=stream.record().buckets,
            subset=list(part) == subset and all(torch.equal(part[n], full[n]) for n in subset),
            stats={n: (s.norm, s.max_abs, s.nonfinite, s.numel) for n, s in stats.params.items()},
            stats_plain=max(
                abs(stats.params[n].norm - float(g.double().norm())) / float(g.double().norm())
                for n, g in plain.items()
            ),
            # | ||a|| - ||b|| | <= ||a - b||: the mean's bound, and the fp32 norm's own rounding
            stats_plain_ratio=max(
                abs(stats.params[n].norm - float(g.double().norm()))
                / float(g.double().norm())
                / (plain_bound[n] + norm_of_sum_of_squares(g.numel(), torch.float32))
                for n, g in plain.items()
            ),
            stats_full={
                n: (
                    # fp32 fragment norms against the fp64 norm of the same values (tests/tolerance.py)
                    abs(stats.params[n].norm - float(g.double().norm()))
                    <= norm_of_sum_of_squares(g.numel(), torch.float32) * float(g.double().norm()),
                    stats.params[n].max_abs == float(g.abs().max()),
                    stats.params[n].numel == g.numel(),
                )
                for n, g in full.items()
            },
        )
        # the rest of the training state after an Adam step: the sharded parameters and Adam's moments
        entry["state"] = _state_read(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad]))
        entry["saved"] = _saved(model, f"{root}/{name}", rank)
        entry["loaded"] = _loaded(model, f"{root}/{name}", mesh, nested, mp)
        # misuse: an unreduced micro-step, and after zero_grad()
        model.set_requires_gradient_sync(False)
        nn.functional.mse_loss(model(x).float(), y).backward()
        entry["no_sync"] = attempt(lambda model=model: collgrad.safe_get_full_model_grad_stats(model))
        model.set_requires_gradient_sync(True)
        nn.functional.mse_loss(model(x).float(), y).backward()
        model.zero_grad()
        # what collgrad kept of the step goes with the gradients: nothing keeps them alive
        entry["released"] = source._held is None and shard() is None
        entry["after_zero_grad"] = attempt(lambda model=model: collgrad.safe_set_full_model_grads(model, {}))
        out[name] = entry
    # Training: an edit written before every step, by set and by update.
    for how in ("set", "update"):
        model = _shard(Net(), mesh, True)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            write_edit(model, how, edit)
            opt.step()
        trained = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        (edited, bound), (unedited, _) = _plain_trained(world, True), _plain_trained(world, False)
        out[f"trained_{how}"] = (
            max(_rel(trained[n], t) / bound[n] for n, t in edited.items()),
            max(_rel(trained[n], t) / bound[n] for n, t in unedited.items()),
        )
    return out


def _state_read(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """fp32 parameters and Adam's states read whole by collgrad, against ``full_tensor()`` of the
    sharded parameters and of the optimizer's state DTensors; counted; and without the optimizer."""
    import collgrad
    from tests.counting import count_collectives

    before = attempt(lambda: collgrad.safe_get_full_model_optimizer_states(model, "exp_avg", optimizer=opt))
    opt.step()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in trainable]
    out: dict = {"before_step": before}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        if key == "fp32":
            full = {n: p.full_tensor() for n, p in trainable}
            with count_collectives() as seen:
                got = collgrad.safe_get_full_model_fp32_params(model)
            streamed = dict(collgrad.iter_full_model_fp32_params(model, bucket_bytes=256))
        else:
            full = {n: opt.state[p][key].full_tensor() for n, p in trainable}
            with count_collectives() as seen:
                got = collgrad.safe_get_full_model_optimizer_states(model, key, optimizer=opt)
            streamed = dict(collgrad.iter_full_model_optimizer_states(model, key, optimizer=opt, bucket_bytes=256))
        out[key] = {
            "names": list(got) == names and sorted(streamed) == sorted(names),
            "bitwise": all(torch.equal(got[n], full[n]) and torch.equal(streamed[n], full[n]) for n in names),
            "dtypes": sorted({str(t.dtype) for t in got.values()}),
            "calls": (seen.data, got.record.buckets),
        }
    out["no_optimizer"] = attempt(lambda: collgrad.safe_get_full_model_optimizer_states(model, "exp_avg"))
    # written back halved, each rank into its own shards: the parameters and the states are the new values
    weights = {n: t * 0.5 for n, t in collgrad.safe_get_full_model_fp32_params(model).items()}
    moments = {
        n: t * 0.5 for n, t in collgrad.safe_get_full_model_optimizer_states(model, "exp_avg", optimizer=opt).items()
    }
    with count_collectives() as seen:
        collgrad.safe_set_full_model_fp32_params(model, weights)
        collgrad.safe_set_full_model_optimizer_states(model, "exp_avg", moments, optimizer=opt)
    out["set"] = {
        "calls": (seen.data, seen.agreements),
        "weights": all(torch.equal(p.full_tensor(), weights[n]) for n, p in trainable),
        "moments": all(torch.equal(opt.state[p]["exp_avg"].full_tensor(), moments[n]) for n, p in trainable),
    }
    # the last rank passes other values: every rank raises before anything is written (HSDP: each rank
    # compares every value, as it cannot tell what a rank of another replica reads)
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    other = {n: t + 1.0 if last else t for n, t in moments.items()}
    out["different"] = attempt(
        lambda: collgrad.safe_set_full_model_optimizer_states(model, "exp_avg", other, optimizer=opt)
    )
    out["kept"] = all(torch.equal(opt.state[p]["exp_avg"].full_tensor(), moments[n]) for n, p in trainable)
    return out


def _saved(model: nn.Module, directory: str, rank: int) -> dict:
    """save_full_model against FSDP2's own consolidation, ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`` (the whole model on rank 0), less the tied alias save_pretrained leaves out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import collgrad
    from tests.counting import count_collectives
    from tests.deepspeed.test_save import _load

    theirs = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with count_collectives() as seen:
        saved = collgrad.save_full_model(model, directory, max_shard_bytes=400)
    torch.distributed.barrier()
    out: dict = {"calls": seen.data, "files": len(saved.files)}
    if rank == 0:
        theirs.pop("head.weight")  # tied to emb.weight: stored once
        loaded, _ = _load(directory)
        out["equal"] = sorted(loaded) == sorted(theirs) and all(torch.equal(loaded[k], theirs[k]) for k in theirs)
    return out


def _loaded(model: nn.Module, directory: str, mesh, nested: bool, mp) -> dict:
    """What save_full_model wrote of ``model`` loaded into a fresh model sharded the same way: its shards
    bitwise ``model``'s (``full_tensor()``), each rank reading only its rows, no collective of data."""
    import collgrad
    from tests.counting import count_collectives

    fresh = _shard(Net(), mesh, nested, mp)
    with count_collectives() as seen:
        loaded = collgrad.load_full_model(fresh, directory)
    theirs = {n: p.full_tensor() for n, p in model.named_parameters()}
    ours = {n: p.full_tensor() for n, p in fresh.named_parameters()}
    total = sum(t.numel() * t.element_size() for t in theirs.values())
    return {
        "equal": list(ours) == list(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs),
        "calls": (seen.data, seen.agreements),
        "share": loaded.bytes_read / total,
        "tensors": loaded.tensors,
    }


@pytest.fixture(scope="module", params=[(2, False), (3, False), (4, True)], ids=["world2", "world3", "hsdp2x2"])
def results(request, tmp_path_factory):
    world, hsdp = request.param
    return world, hsdp, run_ranks(_worker, world, hsdp, str(tmp_path_factory.mktemp("fsdp2")), timeout=600)


VARIANTS = ("nested", "root_only", "mixed_precision")
# bf16 parameters (mixed precision) against fp32, first order: each of the 6 layers on Net's longest
# path (inp, norm, mid, out, emb, head) rounds its weights and output (forward) and its input and weight
# gradients (backward) to bf16, 4 roundings of relative u per layer (CPU bf16 matmuls accumulate in fp32).
_LOW = 4 * 6 * unit_roundoff(torch.bfloat16)


def _entries(results):
    world, hsdp, per_rank = results
    for rank, res in enumerate(per_rank):
        for variant in VARIANTS:
            if variant in res:
                yield world, hsdp, rank, variant, res[variant]


def test_read_is_bitwise_full_tensor_and_close_to_plain_pytorch(results):
    for _world, _hsdp, _rank, variant, e in _entries(results):
        assert e["names"] == e["expected_names"] and "head.weight" not in e["names"]  # tied: once
        assert "frozen.weight" not in e["names"]
        assert e["bitwise"] and e["again"] and e["streamed"] and e["subset"], variant
        assert e["held"] and e["released"], variant  # shards read once a step, let go with the gradients
        assert set(e["dtypes"].values()) == {"torch.float32"}  # mixed precision: reduce_dtype, as FSDP2 keeps it
        if variant == "mixed_precision":  # bf16 forward and backward against fp32: _LOW
            assert e["plain"] < _LOW, (variant, e["plain"], _LOW)
        else:  # a mean of the same local gradients in another order (_plain_grads)
            assert e["plain_ratio"] <= 1, (variant, e["plain_ratio"], e["plain"])


def test_one_collective_per_bucket_over_the_shard_dimension_only(results):
    world, hsdp, per_rank = results
    for _world, _hsdp, rank, _variant, e in _entries(results):
        assert e["data_calls"] == e["buckets"] == 1 and e["agreements"] == 1, e
        # a mix of sizes: one flat gather, laid out parameter-major by collgrad's strided copies (Gloo's own
        # layout would first concatenate the mix of runs: tests/deepspeed/test_full_grads.py, equal layers)
        assert e["primitives"] == ["flat"]
        assert e["stream_buckets"] > 1
        shard_ranks = tuple(range(rank - rank % 2, rank - rank % 2 + 2)) if hsdp else tuple(range(world))
        assert e["groups"] == [("all_gather", shard_ranks)], e["groups"]


def test_stats_equal_plain_pytorch_and_identical_on_every_rank(results):
    _, _, per_rank = results
    for _world, _hsdp, _rank, variant, e in _entries(results):
        assert all(all(ok) for ok in e["stats_full"].values()), e["stats_full"]
        if variant == "mixed_precision":
            assert e["stats_plain"] < _LOW, (e["stats_plain"], _LOW)
        else:
            assert e["stats_plain_ratio"] <= 1, (e["stats_plain_ratio"], e["stats_plain"])
    for variant in VARIANTS:
        if variant in per_rank[0]:
            assert all(res[variant]["stats"] == per_rank[0][variant]["stats"] for res in per_rank)


def test_training_with_an_edit_equals_plain_pytorch(results):
    _, _, per_rank = results
    for res in per_rank:
        for how in ("set", "update"):
            with_edit, without = res[f"trained_{how}"]  # distance over _plain_trained's bound
            assert with_edit <= 1 and without > 1, (how, with_edit, without)


def test_misuse_raises_on_every_rank(results):
    for _world, _hsdp, _rank, _variant, e in _entries(results):
        for phase in ("before_backward", "no_sync", "after_zero_grad"):
            assert e[phase]["error"] == "NotReadyError", (phase, e[phase])
        assert "not a gradient accumulation boundary" in e["no_sync"]["message"]


def test_parameters_and_optimizer_states_read_whole_equal_full_tensor_and_written_back(results):
    for _world, _hsdp, _rank, variant, e in _entries(results):
        state = e["state"]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert state[key]["names"] and state[key]["bitwise"], (variant, key)
            assert state[key]["dtypes"] == ["torch.float32"]  # mixed precision too: FSDP2 steps fp32 shards
            assert state[key]["calls"] == (1, 1), (variant, key, state[key]["calls"])
        # before the first step a torch optimizer holds no state; without optimizer= nothing says where it is
        assert state["before_step"]["error"] == "InvalidArgumentError", state["before_step"]
        assert "after a step" in state["before_step"]["message"]
        assert state["no_optimizer"]["error"] == "InvalidArgumentError", state["no_optimizer"]
        assert "optimizer=" in state["no_optimizer"]["message"]
        assert state["set"] == {"calls": (0, 2), "weights": True, "moments": True}, state["set"]
        assert state["different"]["error"] == "ArgumentMismatchError", (variant, state["different"])
        assert "safe_set_full_model_optimizer_states" in state["different"]["message"]
        assert state["kept"], variant


def test_save_full_model_equals_fsdp2_full_state_dict(results):
    for _world, _hsdp, rank, variant, e in _entries(results):
        assert e["saved"]["files"] > 2 and e["saved"]["calls"] == 1, (variant, e["saved"])  # one bucket
        if rank == 0:
            assert e["saved"]["equal"], variant


def test_load_full_model_puts_each_shard_back_reading_only_its_rows(results):
    world, hsdp, _ = results
    shards = world // 2 if hsdp else world
    for _world, _hsdp, _rank, variant, e in _entries(results):
        loaded = e["loaded"]
        # the two agreements, and one all-to-all: this model's slices are small (a few hundred bytes), each
        # tensor read by one rank that sends the others theirs (none under HSDP: its shard groups' replicas)
        exchanges = 0 if hsdp else 1
        assert loaded["equal"] and loaded["calls"] == (exchanges, 2) and loaded["tensors"] == 13, (variant, loaded)
        # dim-0 rows, uneven: about 1/shards of the bytes (a parameter of fewer rows than ranks read whole
        # by the ranks that hold its rows, none by the others)
        assert loaded["share"] < 1.5 / shards, (variant, loaded)
