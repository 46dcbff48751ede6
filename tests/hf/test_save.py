"""Saving where users save, through save_full_model, on 2 CPU ranks under ZeRO-3 (a tiny GPT-2 built
from a config): ``collgrad.integrations.transformers.save_model(trainer)`` after ``trainer.train()``
and ``collgrad.integrations.accelerate.save_model(accelerator, model, directory)``. The directories
load with ``GPT2LMHeadModel.from_pretrained``: weights bitwise those of
``_zero3_consolidated_16bit_state_dict()`` (what ``trainer.save_model`` and
``accelerator.get_state_dict`` write), logits bitwise those of the trained model. A training state saved
there reads as the model's directory to every tool that reads one, and resumes. A tiny Llama trained
under AutoTP (tensor-parallel 2; ZeRO-1 with an untied, vocabulary-parallel head, ZeRO-3 tied) is saved
whole: ``from_pretrained`` loads every weight unsharded and its logits are the engine's; what
``save_pretrained`` then writes, ``load_full_model`` loads into a fresh engine's shards (its logits bitwise
the trained engine's)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'collgrad[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'collgrad[hf]')")

import torch

from tests.harness import run_ranks
from tests.tolerance import reordered_sum

SHARD = 20_000  # bytes: the tiny GPT-2 (~50 kB) in several shards
IDS = torch.arange(12).reshape(2, 6) % 64


def _model():
    from tests.hf.test_trainer_callback import _model as gpt2

    return gpt2()


def _trainer(rank: int, directory: str):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")  # unused: the process group already exists
    from transformers import Trainer, TrainingArguments

    from tests.deepspeed import models

    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(8):
        ids = torch.randint(0, 64, (8,), generator=gen)
        data.append({"input_ids": ids, "labels": ids})
    cfg = models.config(3)
    cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
    args = TrainingArguments(
        output_dir=directory,
        per_device_train_batch_size=2,
        max_steps=2,
        deepspeed=cfg,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    trainer = Trainer(model=_model(), args=args, train_dataset=data)
    trainer.train()
    return trainer


def _trained(engine) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DeepSpeed's consolidated 16-bit state dict (on rank 0) and the trained model's logits (collective:
    ZeRO-3 gathers for both)."""
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    with torch.no_grad():
        logits = engine.module(input_ids=IDS).logits
    return consolidated, logits


def _compare(directory: str, consolidated: dict, logits: torch.Tensor) -> dict:
    """The saved directory loaded by from_pretrained (outside ZeRO-3's context), against both."""
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(directory)
    state = loaded.state_dict()
    with torch.no_grad():
        loaded_logits = loaded(input_ids=IDS).logits
    return {
        "weights": all(torch.equal(state[k], v) for k, v in consolidated.items()),
        "names": sorted(consolidated) == sorted(state),
        "logits": torch.equal(loaded_logits, logits),
        "trained": not torch.equal(state["transformer.h.0.mlp.c_fc.weight"], _model().transformer.h[0].mlp.c_fc.weight),
        "files": sorted(os.listdir(directory)),
    }


def _worker(rank, world, root):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from collgrad.integrations import accelerate as collgrad_accelerate
    from collgrad.integrations.transformers import save_model
    from tests.deepspeed import models

    saved, trained = {}, {}
    directory = os.path.join(root, "trainer")
    trainer = _trainer(rank, directory)
    saved["trainer"] = save_model(trainer, directory, max_shard_bytes=SHARD).files
    trained["trainer"] = _trained(trainer.deepspeed)

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=models.config(3)))
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * rank + step))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    directory = os.path.join(root, "accelerate")
    saved["accelerate"] = collgrad_accelerate.save_model(accelerator, model, directory, max_shard_bytes=SHARD).files
    engine = accelerator.deepspeed_engine_wrapped.engine
    trained["accelerate"] = _trained(engine)
    resumed = _training_state(rank, engine, os.path.join(root, "training_state"))
    torch.distributed.barrier()
    # loaded as a user would after training: outside ZeRO-3's construction context
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    autotp = {(stage, tied): _autotp(rank, os.path.join(root, f"autotp{stage}"), stage, tied) for stage, tied in AUTOTP}
    if rank != 0:
        return {"autotp": autotp}
    out = {where: (_compare(os.path.join(root, where), *trained[where]), saved[where]) for where in saved}
    out["training_state"] = (
        _read_as_model_directory(os.path.join(root, "training_state"), trained["accelerate"][0]),
        resumed,
    )
    out["autotp"] = autotp
    return out


#: (ZeRO stage, tied embedding and head) of the AutoTP saves
AUTOTP = ((1, False), (3, True))


def _autotp(rank: int, directory: str, stage: int, tied: bool) -> dict:
    """A tiny Llama (vocabulary 37: the untied head splits 19 + 18) trained one step under AutoTP
    tensor-parallel 2, saved with ``save_full_model`` and its config, loaded by ``from_pretrained``: its
    loading report, and whether its logits are this rank's (a vocabulary-parallel head's: its slice of
    the vocabulary) within fp32 rounding (the sharded forward adds the row-parallel layers' partial sums
    across the ranks, the whole one in one matrix product)."""
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import collgrad

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=ds_config
    )
    engine.backward(engine(input_ids=IDS[:1], labels=IDS[:1]).loss)
    engine.step()
    engine.eval()
    with torch.no_grad():
        mine = engine(input_ids=IDS).logits
    collgrad.save_full_model(engine, directory)
    if rank == 0:
        config.save_pretrained(directory)
    torch.distributed.barrier()
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    with torch.no_grad():
        theirs = loaded.eval()(input_ids=IDS).logits
    if mine.shape[-1] != theirs.shape[-1]:  # a vocabulary-parallel head: this rank's slice of the vocabulary
        sizes = engine.module.lm_head.weight.ds_autotp_universal_checkpoint_meta["partition_sizes"]
        theirs = theirs.narrow(-1, sum(sizes[:rank]), sizes[rank])
    # save_pretrained's directory loaded into the shards of a fresh engine: the trained engine's logits
    if rank == 0:
        loaded.save_pretrained(directory + "-pretrained")
    torch.distributed.barrier()
    torch.manual_seed(1)
    fresh = LlamaForCausalLM(config)
    fresh, *_ = deepspeed.initialize(model=fresh, optimizer=torch.optim.Adam(fresh.parameters()), config=ds_config)
    collgrad.load_full_model(fresh, directory + "-pretrained")
    fresh.eval()
    with torch.no_grad():
        again = fresh(input_ids=IDS).logits
    # each of the 2 layers' row-parallel sums (o_proj over 16 inputs, down_proj over 32) added in two
    # partial sums across the ranks instead of one: a reordered sum of at most 32 terms per layer
    # (tests/tolerance.py), relative to the logits' scale, and never wider than the 1e-6 this test had
    bound = 2 * reordered_sum(32)
    return {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "logits": torch.allclose(mine, theirs, rtol=bound, atol=min(1e-6, bound * float(theirs.abs().max()))),
        "loaded into the shards": torch.equal(again, mine),
    }


def _training_state(rank: int, engine, directory: str) -> bool:
    """The engine's training state saved (a config beside it, as a user puts one), one more step taken,
    and the state loaded back from the same directory: every fp32 master and Adam state as saved."""
    import collgrad

    def held() -> dict:
        out = {"fp32": collgrad.safe_get_full_model_fp32_params(engine)}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = collgrad.safe_get_full_model_optimizer_states(engine, key)
        return out

    collgrad.save_training_state(engine, directory, max_shard_bytes=SHARD)
    if rank == 0:
        _model().config.save_pretrained(directory)
    at_save = held()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(99 + rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    collgrad.load_training_state(engine, directory)
    again = held()
    return all(torch.equal(again[k][n], t) for k in at_save for n, t in at_save[k].items())


def _read_as_model_directory(directory: str, consolidated: dict) -> dict:
    """A training state's directory read as every tool reads a model directory: ``from_pretrained``, PyTorch
    DCP's ``HuggingFaceStorageReader`` (every ``*.safetensors`` file of the directory) and a glob of
    ``*.safetensors``; each gets the module's weights (a tied one once, under its first name), nothing else."""
    import glob

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import GPT2LMHeadModel

    globbed: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        found = load_file(file)
        assert not set(found) & set(globbed), file  # every tensor once
        globbed.update(found)
    via_dcp = {name: torch.empty_like(t) for name, t in globbed.items()}
    dcp.load(via_dcp, storage_reader=HuggingFaceStorageReader(directory), no_dist=True)
    loaded = GPT2LMHeadModel.from_pretrained(directory).state_dict()
    return {
        "glob names": sorted(globbed),
        "aliases left out": sorted(set(consolidated) - set(globbed)),
        "glob": all(torch.equal(t, consolidated[n]) for n, t in globbed.items()),
        "dcp": all(torch.equal(t, consolidated[n]) for n, t in via_dcp.items()),
        "from_pretrained": sorted(loaded) == sorted(consolidated)
        and all(torch.equal(loaded[n], t) for n, t in consolidated.items()),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("hfsave")), timeout=600)


@pytest.mark.parametrize("where", ["trainer", "accelerate"])
def test_from_pretrained_loads_what_was_trained(results, where):
    compared, files = results[0][where]
    assert compared["names"] and compared["weights"] and compared["logits"] and compared["trained"], compared
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    assert set(files) <= set(compared["files"]) and "config.json" in compared["files"]
    assert not [f for f in compared["files"] if f.startswith(".")]  # no temporary file left


def test_a_training_states_directory_reads_as_the_models_directory_and_still_resumes(results):
    """from_pretrained, DCP's HuggingFaceStorageReader and a *.safetensors glob of a training state's
    directory get exactly the module's weights (no fp32 master or optimizer state read as a weight), and
    the same directory resumes the engine's masters and Adam states bitwise."""
    read, resumed = results[0]["training_state"]
    assert read["glob names"] and read["aliases left out"] == ["lm_head.weight"], read
    assert read["glob"] and read["dcp"] and read["from_pretrained"], read
    assert resumed


def test_autotp_saves_load_whole_with_from_pretrained(results):
    for rank, res in enumerate(results):
        for config, loaded in res["autotp"].items():
            expected = {"missing": [], "unexpected": [], "logits": True, "loaded into the shards": True}
            assert loaded == expected, (rank, config, loaded)
