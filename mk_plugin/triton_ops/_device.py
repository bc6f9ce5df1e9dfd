"""Host-side facts about where an op runs, shared by every op wrapper (cached property queries:
no device sync, safe before and during CUDA-graph capture once warmed up)."""
from __future__ import annotations

import functools
import os
import re

import torch

H200_SMS = 132  # the SM count assumed off-GPU (interpreter), so CPU and H200 pick the same configs


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_sms(device: torch.device) -> int:
    """SM count of a CUDA device; H200_SMS for any other device."""
    return _sms_of(_index(device)) if device.type == "cuda" else H200_SMS


def device_name(device: torch.device) -> str | None:
    """The CUDA device's model name (keys measured configs), None off-GPU."""
    return _name_of(_index(device)) if device.type == "cuda" else None


def gpu_slug(name: str) -> str:
    """A GPU model name as a file-name part ("NVIDIA H200" -> "nvidia_h200"): how tables of measured
    configs are named per GPU model."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
