"""Imported by Python at start-up in the test suite's GPT subprocesses (their PYTHONPATH starts here).

Lightning's DeepSpeedStrategy refuses every accelerator but CUDA, yet DeepSpeed itself runs ZeRO on the
CPU (its CPU accelerator, with gloo). This lifts only that guard, so the tests run the real ZeRO-2/3 and
offload code through Fabric on a machine without a GPU. fabric_gpt.py sees the `cpu_allowed` mark and
accepts a DeepSpeed strategy on CPU only then; users without GPUs get a clear error instead.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.fabric.strategies import deepspeed as lightning_deepspeed  # noqa: E402
from lightning.fabric.strategies.ddp import DDPStrategy  # noqa: E402
from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402


def setup_environment(self) -> None:
    DDPStrategy.setup_environment(self)  # what DeepSpeedStrategy.setup_environment does after its CUDA check


setup_environment.cpu_allowed = True
DeepSpeedStrategy.setup_environment = setup_environment
# CPU devices have no index; the check that GPU indices match local ranks does not apply to them.
lightning_deepspeed._validate_device_index_selection = lambda devices: None

import deepspeed  # noqa: E402

_initialize = deepspeed.initialize


def initialize(*args, **kwargs):
    """Lightning passes the device index as DeepSpeed's device_rank; a CPU device has none, so use the local rank."""
    ns = kwargs.get("args")
    if ns is not None and getattr(ns, "device_rank", 0) is None:
        ns.device_rank = int(os.environ.get("LOCAL_RANK", 0))
    return _initialize(*args, **kwargs)


deepspeed.initialize = initialize
