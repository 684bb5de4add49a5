"""The process the benchmark runs in: DeepSpeed's accelerator, a one-rank
process group, quiet libraries, engines, the device, the versions.

deepspeed and transformers are imported where they are needed, not here:
DeepSpeed picks its accelerator when it is first imported, so
:func:`setup` checks it first.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import platform
import socket
import sys
import warnings
from typing import Any

import torch

import graphscale as gs
from graphscale import observe

from .spec import HF_SHAPES, HF_VOCAB, PROG, Size


def check_accelerator(device: str) -> bool:
    """DeepSpeed puts engines on its accelerator's device, whatever device the
    module was moved to: the two must agree (an inherited DS_ACCELERATOR=cpu
    under --device cuda would time CPU engines).  False (and a message) when
    they do not, or when cuda is asked for and torch sees no GPU."""
    accelerator = os.environ.setdefault("DS_ACCELERATOR", device)
    if accelerator != device:
        print(f"{PROG}: --device {device} but DS_ACCELERATOR={accelerator}; "
              f"unset it or set DS_ACCELERATOR={device}", file=sys.stderr)
        return False
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: --device cuda but torch sees no GPU", file=sys.stderr)
        return False
    return True


def setup(device: str, threads: int) -> bool:
    """The process as the benchmark needs it: DeepSpeed's accelerator checked,
    torch's CPU threads set, the libraries quiet, a one-rank process group.
    False (after a message) when the device cannot be used."""
    if not check_accelerator(device):
        return False
    torch.set_num_threads(threads)
    quiet_libraries()
    init_dist(device)
    quiet_libraries()  # again: importing and initializing deepspeed may reset its loggers' levels
    return True


def quiet_libraries() -> None:
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*")
    warnings.filterwarnings("ignore", message=".*use_cache=True.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def init_dist(device: str) -> None:
    """A one-rank process group on a free local port (nccl on cuda, gloo on cpu)."""
    if torch.distributed.is_initialized():
        return
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def make_engine(module: Any, gas: int) -> Any:
    """A ZeRO-1 DeepSpeed engine over ``module`` (SGD, lr 0), GAS ``gas``."""
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wait_for_walker() -> str:
    """``"native"`` or ``"python"``, once graphscale's native walker has been
    built or loaded (or has failed): a background build on a fresh machine is
    waited for before anything is timed."""
    return "native" if observe.walker() == "native" else "python"


def device_name(device: str, threads: int) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, {threads} torch thread(s)"


def run_meta(device: str, threads: int, walker: str, build_s: float, sizes: list[Size], reps: int,
             layers: int) -> dict[str, Any]:
    """The run's environment and measuring choices: device, versions, walker,
    shapes, how memory is measured (the JSON's ``meta``)."""
    import deepspeed

    meta: dict[str, Any] = {
        "device": device_name(device, threads),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "graphscale": gs.__version__,
        "python": platform.python_version(),
        "walker": walker,
        "native_build_or_load_s": build_s,
        "reps": reps,
        "layers_per_engine": layers,
        "sizes": [vars(s) for s in sizes],
        "hf_shapes": HF_SHAPES,
        "hf_vocab": HF_VOCAB,
        "zero_stage": 1,
        "memory_measure": ("torch.cuda.max_memory_allocated above the start" if device == "cuda"
                           else "peak tensor bytes above the start (torch profiler, profile_memory=True)"),
        "plot_whiskers": "inter-quartile range (25th-75th percentile) of the per-round ratios",
        "wall_s": None,
    }
    if have_transformers():
        import transformers

        meta["transformers"] = transformers.__version__
    return meta
