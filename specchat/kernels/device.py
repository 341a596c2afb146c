"""What the kernels size their grids by on the device they run on."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the Triton interpreter, the CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


ARRIVAL_COUNTERS = 1 << 16  # int32 counters a device keeps for kernels whose last program to finish does the rest
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's ARRIVAL_COUNTERS arrival counters (int32, zero between launches: a kernel's last program to
    arrive at one sets it back to 0), for kernels that end with one program finishing what all of them wrote (the
    attention's merge, the dense GEMV's norm). Made once, so CUDA graphs captured with them keep a live buffer;
    launches on one stream share them, one after another. None where first asked during a graph's capture: zeros
    written there would only be written when the graph replays."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return counters
