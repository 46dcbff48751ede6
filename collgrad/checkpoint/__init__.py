"""Checkpoints: everything that reads or writes a checkpoint file, above ``collgrad.state`` (which never
imports it) and below the public API (collgrad/__init__.py: this package only holds the modules). See
docs/design.md.

safetensors.py   the format both ways: headers laid out for a save, read back as untrusted input
manifest.py      a training state's manifest: what is where, the rest as JSON (never a pickle)
plan.py          pure: layouts + this rank + headers -> write and read items (ranges, files, offsets)
storage.py       the one writer and the one reader: move the items' bytes between files and memory
commit.py        temporaries, flush, rename last, stale sweep; the one probe for a shared directory
match.py         a model as a checkpoint sees it, and the one check of a checkpoint against it
agree.py         one phase of a call agreed by every rank (a failure anywhere raises everywhere)
save.py          save_full_model            \
load.py          load_full_model             |  each job: check -> plan -> execute -> commit,
training.py      save/load_training_state    |  top to bottom in its file
background.py    async_save_training_state   |  (training.py's save, written by a thread)
convert.py       convert_deepspeed_checkpoint (deepspeed_checkpoint.py: DeepSpeed's files, untrusted) /
"""
