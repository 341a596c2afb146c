"""A worker rank (1..N-1): load its shard, then run what rank 0 sends until it says stop.

Started by rank 0 with torch.multiprocessing (spawn: `spawned_worker`) or by torchrun, where every rank runs the
command and ranks > 0 turn into workers inside Engine.load (`run_worker`). Either way the worker reads the model
path from the rendezvous store (rank 0 fetches the model first, so that no two processes download it), reports
`tp/ready/<rank>` or `tp/error/<rank>` there, joins the groups and serves rank 0's messages (engine.tp.messages).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

from specchat.config import EngineConfig
from specchat.engine.loading import pick_device, pick_dtype
from specchat.engine.tp.group import HOST, STORE_TIMEOUT, TPGroup, keep_multicast_off, rank_device
from specchat.engine.tp.layers import parallelize
from specchat.engine.tp.load import load_rank
from specchat.engine.tp.messages import Stop, WorkerState
from specchat.errors import SpecchatError

log = logging.getLogger(__name__)
PATH_KEY = "tp/path"
POLL_S = 0.05


def ready_key(rank: int) -> str:
    return f"tp/ready/{rank}"


def error_key(rank: int) -> str:
    return f"tp/error/{rank}"


def wait_for_key(store: dist.Store, key: str) -> bytes:
    """The value of `key`, however long rank 0 takes to set it (fetching a model can take minutes)."""
    while not store.check([key]):
        time.sleep(POLL_S)
    return store.get(key)


def spawned_worker(rank: int, tp: int, config: EngineConfig, port: int) -> None:
    """The target of a worker process started by rank 0."""
    keep_multicast_off()
    store = dist.TCPStore(HOST, port, tp, False, timeout=STORE_TIMEOUT)
    raise SystemExit(run_worker(store, rank, tp, config))


def run_worker(store: dist.Store, rank: int, tp: int, config: EngineConfig) -> int:
    """Load, report, serve; returns the process's exit status."""
    keep_multicast_off()
    path = Path(wait_for_key(store, PATH_KEY).decode())
    device = rank_device(pick_device(config.device), rank)
    try:
        shard = load_rank(path, rank, tp, pick_dtype(config.dtype, device), device, config.weights)
    except Exception as exc:  # reported to rank 0, which ends in one line; a bug's traceback goes to the log
        if not isinstance(exc, SpecchatError):
            log.exception("tensor-parallel rank %d failed to load", rank)
        store.set(error_key(rank), f"{exc}" if isinstance(exc, SpecchatError) else f"{type(exc).__name__}: {exc}")
        return 1
    store.set(ready_key(rank), "1")
    group = TPGroup.connect(store, rank, tp, device)
    worker = WorkerState(parallelize(shard.model, group), device)
    del shard
    return serve(worker, group)


def serve(worker: WorkerState, group: TPGroup) -> int:
    """Apply rank 0's messages in order until Stop; a rank 0 that went away ends the worker quietly."""
    while True:
        try:
            message = group.receive()
        except RuntimeError:  # the control group's connection to rank 0 closed: it exited or was killed
            return 0
        if isinstance(message, Stop):
            return 0
        message.apply(worker)
