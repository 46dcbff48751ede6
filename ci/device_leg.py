"""A device leg of the test matrix (tox -e cuda-nccl, tox -e xpu-xccl): on a machine without such a
device, say why and stop in seconds, before installing anything; otherwise install collgrad with its
test extras into the leg's environment and run the leg's tests.

    python ci/device_leg.py cuda|xpu [pytest arguments...]

The check is cheap and errs towards running: device nodes, or the vendor's tool listing a device.
Where it finds one, pytest's own markers still skip, saying why, what the installed torch cannot
use (no CUDA build, no NCCL, no XCCL). ``COLLGRAD_DEVICE_LEG=run`` skips the check.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_device() -> str | None:
    """Where a CUDA device shows, or None."""
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        return f"device nodes {', '.join(nodes)}"
    if os.path.exists("/dev/dxg"):  # WSL 2 exposes GPUs through one node
        return "/dev/dxg (WSL)"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        if listed.returncode == 0 and "GPU" in listed.stdout:
            return f"nvidia-smi -L: {listed.stdout.strip().splitlines()[0]}"
    return None


def xpu_device() -> str | None:
    """Where an Intel GPU usable through Level Zero shows (a render node and the loader), or None."""
    nodes = sorted(glob.glob("/dev/dri/renderD*"))
    if not nodes:
        return None
    loader = ctypes.util.find_library("ze_loader")
    if loader is None:  # a render node alone is any GPU (an integrated one, a virtual one)
        return None
    return f"render nodes {', '.join(nodes)} and Level Zero ({loader})"


EXTRAS = "test,deepspeed"
LEGS = {
    # leg (also its pytest marker): (the check, why the leg skips without the device)
    "cuda": (cuda_device, "no CUDA device on this machine (no /dev/nvidia*, no GPU in nvidia-smi -L)"),
    "xpu": (xpu_device, "no XPU device on this machine (no /dev/dri/renderD* with Level Zero)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in LEGS:
        print(f"usage: {sys.argv[0]} {'|'.join(LEGS)} [pytest arguments...]", file=sys.stderr)
        return 2
    leg, rest = argv[0], argv[1:]
    check, missing = LEGS[leg]
    if os.environ.get("COLLGRAD_DEVICE_LEG") != "run":
        found = check()
        if found is None:
            print(f"{leg} leg: SKIPPED, {missing}; nothing installed, no test run.")
            return 0
        print(f"{leg} leg: {found}: installing collgrad[{EXTRAS}] and running pytest -m {leg}")
    # PIP_CONSTRAINT (tox's setenv: COLLGRAD_CONSTRAINTS, default the CPU pins) applies here as in tox.
    subprocess.run([sys.executable, "-m", "pip", "install", f"{ROOT}[{EXTRAS}]"], check=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-m", leg, "-rs", *rest], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
