import os

import pytest

# DeepSpeed on the CPU accelerator (Gloo). Each test module skips, saying why, where deepspeed is not
# installed (pytest.importorskip at its top), rather than vanishing from the run.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def _deepspeed_env(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
