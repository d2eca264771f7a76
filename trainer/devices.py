"""Which device a rank trains on and which backend carries its messages: pure choices.

Device (config key ``device``)
    ``"auto"``: the rank's GPU when CUDA is available, ``cuda:(local_rank % gpus)`` with the
    launcher's local rank (torchrun's ``LOCAL_RANK``, MPI's, Slurm's; 0 when unknown), else the
    CPU. ``"cpu"``. ``"cuda"``: the rank's GPU as for ``auto``, and an error without CUDA.
    ``"cuda:N"``: that GPU.

Backend (config key ``backend``)
    ``"auto"``: NCCL for a CUDA device, gloo for the CPU. ``"nccl"`` needs a CUDA device.
    ``"gloo"`` with a CUDA device stages every message through page-locked host memory
    (:mod:`trainer.comm`): slower, but it lets several ranks share one GPU, which NCCL refuses
    ("Duplicate GPU detected").

:func:`check_gpus` refuses an NCCL job with more ranks on a node than GPUs before anything is
started, with a message saying how to share GPUs deliberately; :func:`ranks_on_device` counts the
ranks that share a device's memory (``trainer.preflight.check_memory``).
"""

from __future__ import annotations

import torch

__all__ = ["BACKENDS", "check_gpus", "pick_backend", "pick_device", "ranks_on_device"]

BACKENDS = ("auto", "nccl", "gloo")


def pick_device(setting: str, *, gpus: int, local_rank: int | None) -> torch.device:
    """The device of ``setting`` (module docstring) on a node with ``gpus`` CUDA devices.

    Raises:
        ValueError: naming the setting: an unknown one, CUDA asked for without a GPU, or a GPU
            index the node does not have.
    """
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "auto" and gpus == 0:
        return torch.device("cpu")
    if setting in ("auto", "cuda"):
        if gpus == 0:
            raise ValueError("device 'cuda': CUDA is not available on this node")
        return torch.device("cuda", (local_rank or 0) % gpus)
    if setting.startswith("cuda:"):
        try:
            index = int(setting[5:])
        except ValueError:
            raise ValueError(f"device {setting!r}: expected cuda:N") from None
        if not 0 <= index < gpus:
            raise ValueError(f"device {setting!r}: this node has {gpus} GPU(s)")
        return torch.device("cuda", index)
    raise ValueError(f"device {setting!r}: expected auto, cpu, cuda or cuda:N")


def ranks_on_device(setting: str, device: torch.device, *, gpus: int, ranks_per_node: int) -> int:
    """The ranks of this node that ``setting`` puts on ``device`` (:func:`pick_device` of every
    local rank; a node's ranks share its host memory, a GPU's its device memory)."""
    if device.type != "cuda":
        return ranks_per_node
    return sum(
        pick_device(setting, gpus=gpus, local_rank=r) == device for r in range(ranks_per_node)
    )


def pick_backend(setting: str, device: torch.device) -> str:
    """``"nccl"`` or ``"gloo"`` for ``setting`` (module docstring) and the rank's ``device``.

    Raises:
        ValueError: an unknown setting, or NCCL for a CPU device.
    """
    if setting not in BACKENDS:
        raise ValueError(f"backend {setting!r}: expected one of {', '.join(BACKENDS)}")
    if setting == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if setting == "nccl" and device.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA device (device = 'cpu' was chosen)")
    return setting


def check_gpus(backend: str, device: torch.device, *, ranks_per_node: int, gpus: int) -> None:
    """Refuse an NCCL job with more ranks on a node than GPUs (NCCL needs one GPU per rank).

    Raises:
        ValueError: saying how many ranks and GPUs there are, and the way to share GPUs.
    """
    if backend == "nccl" and device.type == "cuda" and ranks_per_node > gpus:
        raise ValueError(
            f"{ranks_per_node} ranks on this node but {gpus} GPU(s): NCCL needs one GPU per "
            "rank. Launch at most one rank per GPU, or set backend = 'gloo' to share GPUs "
            "(messages then go through host memory)"
        )
