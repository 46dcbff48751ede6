import importlib.util
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

if importlib.util.find_spec("deepspeed") is None:
    collect_ignore_glob = ["test_*.py"]

    def pytest_collection_modifyitems(items):  # pragma: no cover - only without deepspeed
        pass


@pytest.fixture(autouse=True)
def _deepspeed_env(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
