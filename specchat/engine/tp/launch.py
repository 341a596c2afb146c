"""`TPEngine`: an Engine whose model is split over N ranks; rank 0 is this process and keeps the scheduler and UI.

    engine = Engine.load(EngineConfig(model=..., tp=2))   # Engine.load hands tp > 1 to TPEngine.load_tp

The workers are started here with torch.multiprocessing (spawn), one per GPU (or N host processes on the CPU),
or, when the command itself runs under `torchrun --nproc-per-node N`, they are torchrun's ranks 1..N-1, which turn
into workers inside this call and never return from it. Then every rank loads its shard (engine.tp.load), they
join the groups (engine.tp.group), and rank 0 builds an ordinary Engine around its shard (engine.tp.leader says
what it adds). The engine runs eagerly: CUDA-graph capture of the collectives is left for a multi-GPU machine
(docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specchat.config import EngineConfig
from specchat.engine.engine import Engine
from specchat.engine.kv_cache import KVPool
from specchat.engine.loader import Progress
from specchat.engine.loading import default_kv_budget, load_tokenizer, pick_device, pick_dtype
from specchat.engine.tp.group import HOST, STORE_TIMEOUT, TPGroup, keep_multicast_off, rank_device
from specchat.engine.tp.layers import parallelize
from specchat.engine.tp.leader import FixedWeights, MirroredStore, send_forwards, tp_drafter_check
from specchat.engine.tp.load import load_rank, read_checkpoint
from specchat.engine.tp.messages import PoolSpec, Stop
from specchat.engine.tp.shard import check_mxfp4_tp, check_tp
from specchat.engine.tp.worker import PATH_KEY, POLL_S, error_key, ready_key, run_worker, spawned_worker
from specchat.errors import ConfigError, SpecchatError
from specchat.quant.checkpoint import checkpoint_metadata
from specchat.quant.handler import WeightSources
from specchat.registry import fetch, resolve

STOP_WAIT_S = 10.0  # for a worker to leave after Stop, before it is terminated


class TPWorkers:
    """The worker ranks as rank 0 sees them: their processes (none under torchrun) and how to stop them."""

    def __init__(self, store: dist.Store, tp: int, processes: list) -> None:
        self.store, self.tp, self.processes = store, tp, processes
        self.group: TPGroup | None = None

    def wait_ready(self) -> None:
        """Until every worker has loaded its shard; one line if one failed."""
        pending = set(range(1, self.tp))
        while pending:
            for rank in sorted(pending):
                if self.store.check([error_key(rank)]):
                    self.stop()
                    error = self.store.get(error_key(rank)).decode()
                    raise SpecchatError(f"--tp {self.tp}: rank {rank} could not load its shard: {error}")
                if self.store.check([ready_key(rank)]):
                    pending.discard(rank)
            dead = [p for rank, p in enumerate(self.processes, 1) if rank in pending and p.exitcode is not None]
            if dead and not any(self.store.check([error_key(r)]) for r in pending):
                self.stop()
                raise SpecchatError(f"--tp {self.tp}: a worker process exited with status {dead[0].exitcode}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Tell the workers to leave (if they joined), then wait for them; terminate those that stay."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):  # a worker that is gone already
                group.send(Stop())
        for process in self.processes:
            process.join(STOP_WAIT_S if group is not None else 0)  # a worker that never joined waits for nothing
            if process.exitcode is None:
                process.terminate()
                process.join()
        self.processes = []


def start_workers(config: EngineConfig) -> tuple[dist.Store, TPWorkers]:
    """The rendezvous store and the workers: spawned here, or torchrun's (this process being one of its ranks).

    Under torchrun a rank > 0 becomes a worker and exits the process when rank 0 stops it.
    """
    keep_multicast_off()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by torchrun
        if world != config.tp:
            raise ConfigError(
                f"--tp {config.tp} under torchrun with {world} processes: give --nproc-per-node {config.tp}"
            )
        store, rank, _ = next(dist.rendezvous("env://", int(os.environ["RANK"]), world))
        if rank > 0:
            raise SystemExit(run_worker(store, rank, config.tp, config))
        return store, TPWorkers(store, config.tp, [])
    store = dist.TCPStore(HOST, 0, config.tp, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    context = mp.get_context("spawn")
    processes = []
    for rank in range(1, config.tp):
        process = context.Process(
            target=spawned_worker, args=(rank, config.tp, config, store.port), name=f"specchat-tp{rank}", daemon=True
        )
        process.start()
        processes.append(process)
    return store, TPWorkers(store, config.tp, processes)


class TPEngine(Engine):
    """An Engine over rank 0's shard; the workers run every forward with it (see the module docstring)."""

    workers: TPWorkers

    @classmethod
    def load_tp(cls, config: EngineConfig, progress: Progress | None = None) -> TPEngine:
        tp = config.tp
        spec = resolve(config.model)
        device = pick_device(config.device)
        if device.type == "cuda" and tp > torch.cuda.device_count():
            raise ConfigError(f"--tp {tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
        path = fetch(spec, progress=progress)
        checkpoint = read_checkpoint(path, progress)
        check_tp(checkpoint[0], tp)
        meta = checkpoint_metadata(path)
        if meta is not None or config.weights == "mxfp4":
            check_mxfp4_tp(checkpoint[0], tp)
        store, workers = start_workers(config)
        try:
            engine = cls._load_rank0(config, spec, Path(path), checkpoint, meta, store, workers, device)
        except BaseException:
            workers.stop()
            raise
        return engine

    @classmethod
    def _load_rank0(cls, config, spec, path, checkpoint, meta, store, workers, device) -> TPEngine:
        store.set(PATH_KEY, str(path))
        here = rank_device(device, 0)
        dtype = pick_dtype(config.dtype, here)
        shard = load_rank(path, 0, config.tp, dtype, here, config.weights, checkpoint)
        del checkpoint
        workers.wait_ready()
        group = TPGroup.connect(store, 0, config.tp, here)
        workers.group = group
        model = parallelize(shard.model, group)
        c = model.cfg
        budget = config.kv_memory or default_kv_budget(here)
        kv = (c.num_layers, c.num_kv_heads, c.head_dim, config.page_size, dtype, here, config.kv_format)
        pool = KVPool.from_budget(budget, *kv, rotate=config.kv_rotation)
        group.send(PoolSpec.of(pool, dtype))
        pool.store = MirroredStore(pool.store, group)
        send_forwards(model, group, pool)
        weights = FixedWeights(
            model, WeightSources(path, checkpoint=meta is not None), shard.weights_format, shard.weights_method
        )
        tokenizer = load_tokenizer(spec, path)
        engine = cls(model, tokenizer, pool, dataclasses.replace(config, eager=True), spec, weights)
        engine.workers = workers
        engine.drafters.build = tp_drafter_check(engine.drafters.build, spec, config.tp)
        return engine

    def close(self) -> None:
        """Stop the step loop, then the workers."""
        super().close()
        self.workers.stop()
