"""Screening transforms of the keys before MXFP4 quantization: perplexity with every layer's keys fake-quantized.

    python benchmarks/kv_key_transforms.py [--text dev_queue.txt] [--windows 2] [--schemes "H64,cs center H64"]

A quick proxy for `specchat perplexity --kv mxfp4`, to rank ideas before building them into the page store: each
window of 1024 tokens runs as one prefill whose keys (and, for the k4v4 / k8v4 schemes, values) go through
quantize -> dequantize before attention, so every token reads its whole context quantized (harsher than the
sliding-window tool, where the history chunk of a window attends to itself unquantized).

A key transform is exact whenever the queries get the inverse-transpose: (q A^-T)(k A)^T = q k^T, and subtracting
one vector c from every key shifts every score of a query by the same q.c, which the softmax ignores. So all
schemes below change only what the quantizer sees:

- H64 / H32: the page store's Hadamard rotation (one 64-point block, or two 32-point blocks).
- center: subtract the calibrated mean key c of each (layer, KV head).
- cs: scale channel i of k by 1/s_i and of q by s_i with s_i = sqrt(rms(k_i) / rms(q_i)), which minimises
  sum_i E[k_i^2] / s_i^2 * sum_i E[q_i^2] s_i^2 (Cauchy-Schwarz), the product the score error of an isotropic
  quantization error grows with (as SmoothQuant's migration, between q and k).
- geo: the full-matrix version, k -> k A with A A^T = Sk^-1 # Sq (the matrix geometric mean of the key and query
  second moments), then H64.

Means, rms and second moments are calibrated on the calibration text (calibration_heapq.txt), never on the text
scored. Weights are the model's as loaded (float32 on the CPU).
"""

from __future__ import annotations

import argparse
import math
import time
from importlib import resources

import torch

from specchat.config import EngineConfig
from specchat.engine import kv_batch
from specchat.engine.engine import Engine
from specchat.engine.kv_pages import hadamard
from specchat.engine.runner import StepBatch
from specchat.kernels.kv_quant import dequantize_mxfp4_rows, dequantize_mxfp8, quantize_mxfp4_rows, quantize_mxfp8

CALIBRATION_TEXT = "calibration_heapq.txt"
CONTEXT = 1024


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4_rows(*quantize_mxfp4_rows(x), torch.float32)


def mxfp8(x: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8(*quantize_mxfp8(x))


def psd_power(a: torch.Tensor, p: float) -> torch.Tensor:
    w, v = torch.linalg.eigh(a.double())
    return (v * w.clamp(min=1e-12) ** p) @ v.T


class KeyStats:
    """Per layer: keys [N, KVH, D] and queries [N, KVH, G, D] of the calibration text."""

    def __init__(self, keys: dict[int, torch.Tensor], queries: dict[int, torch.Tensor]) -> None:
        self.keys, self.queries = keys, queries

    def mean(self, layer: int) -> torch.Tensor:
        return self.keys[layer].mean(0)  # [KVH, D]

    def cs_scale(self, layer: int, center: bool) -> torch.Tensor:
        k = self.keys[layer] - (self.mean(layer) if center else 0.0)
        k_rms = k.pow(2).mean(0).sqrt()  # [KVH, D]
        q_rms = self.queries[layer].pow(2).mean((0, 2)).sqrt()  # [KVH, D]
        return (k_rms.clamp(min=1e-4) / q_rms.clamp(min=1e-4)).sqrt()

    def geo_matrix(self, layer: int, center: bool, eps: float = 1e-3) -> torch.Tensor:
        """A [KVH, D, D] with A A^T = Sk^-1 # Sq (each second moment with eps of its mean eigenvalue added)."""
        k = self.keys[layer] - (self.mean(layer) if center else 0.0)
        out = []
        for h in range(k.shape[1]):
            kh, qh = k[:, h].double(), self.queries[layer][:, h].reshape(-1, k.shape[-1]).double()
            eye = torch.eye(k.shape[-1], dtype=torch.float64)
            sk = kh.T @ kh / len(kh)
            sq = qh.T @ qh / len(qh)
            sk, sq = sk + eps * sk.trace() / len(eye) * eye, sq + eps * sq.trace() / len(eye) * eye
            root, inv_root = psd_power(sk, 0.5), psd_power(sk, -0.5)
            out.append(psd_power(inv_root @ psd_power(root @ sq @ root, 0.5) @ inv_root, 0.5).float())
        return torch.stack(out)


def key_scheme(name: str, stats: KeyStats, head_dim: int):
    """(layer, k [T, KVH, D]) -> k after transform, quantize, dequantize and the inverse transform."""
    parts = name.split()
    quant = mxfp8 if parts[0] == "k8" else mxfp4
    parts = [p for p in parts if p not in ("k4", "k8")]
    rotation = {"H64": hadamard(64), "H32": torch.block_diag(hadamard(32), hadamard(32)), "none": None}[parts[-1]]
    rotation = torch.eye(head_dim) if rotation is None else rotation
    center, cs, geo = "center" in parts, "cs" in parts, "geo" in parts

    def apply(layer: int, k: torch.Tensor) -> torch.Tensor:
        c = stats.mean(layer) if center else torch.zeros(k.shape[1:])
        x = k - c
        if geo:
            a = stats.geo_matrix(layer, center)  # [KVH, D, D]
            y = torch.einsum("thd,hde->the", x, a)
            y = quant(y @ rotation) @ rotation.T
            return torch.einsum("the,hed->thd", y, torch.linalg.inv(a)) + c
        s = stats.cs_scale(layer, center) if cs else torch.ones(k.shape[1:])
        return quant((x / s) @ rotation) @ rotation.T * s + c

    return apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="dev_queue.txt", help="a file of specchat/data/text")
    parser.add_argument("--windows", type=int, default=2, help=f"windows of {CONTEXT} tokens")
    parser.add_argument("--values", choices=("dense", "mxfp4"), default="dense", help="values quantized too")
    parser.add_argument(
        "--schemes", default="none,k4 H64,k4 H32,k4 none,k4 center H64,k4 cs H64,k4 cs H32,k4 cs center H64"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(device="cpu", kv_memory=1 << 28))
    cfg = engine.model.cfg
    group = cfg.num_heads // cfg.num_kv_heads
    folder = resources.files("specchat").joinpath("data", "text")
    state: dict = {"key": None, "capture": None}
    plain_attend = kv_batch.KVBatch.attend

    def attend(self, layer, q, k, v):
        if state["capture"] is not None:
            state["capture"].setdefault(layer, []).append((q.detach().clone(), k.detach().clone()))
        if state["key"] is not None:
            k = state["key"](layer, k)
            if args.values == "mxfp4":
                rotation = hadamard(cfg.head_dim)
                v = mxfp4(v @ rotation) @ rotation.T
        return plain_attend(self, layer, q, k, v)

    kv_batch.KVBatch.attend = attend

    def perplexity(ids: list[int]) -> float:
        nll, count = 0.0, 0
        for w in range(args.windows):
            window = ids[w * CONTEXT : (w + 1) * CONTEXT + 1]
            if len(window) < 2:
                break
            engine.pool.add(-1, [])
            try:
                logits = engine.runner.forward(StepBatch([-1], [window[:-1]], [0], [len(window) - 1])).logits[0]
            finally:
                engine.pool.free(-1)
            targets = torch.tensor(window[1:])
            nll -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).double().sum())
            count += len(targets)
        return math.exp(nll / count)

    state["capture"] = {}
    perplexity(engine.tokenizer.encode(folder.joinpath(CALIBRATION_TEXT).read_text()))
    captured, state["capture"] = state["capture"], None
    stats = KeyStats(
        {layer: torch.cat([k for _, k in rows]) for layer, rows in captured.items()},
        {layer: torch.cat([q for q, _ in rows]).unflatten(1, (-1, group)) for layer, rows in captured.items()},
    )
    ids = engine.tokenizer.encode(folder.joinpath(args.text).read_text())
    print(f"{args.text}: {min(len(ids) - 1, args.windows * CONTEXT)} tokens scored, values {args.values}")
    print("| keys | ppl | vs dense KV | s |\n| --- | --- | --- | --- |")
    baseline = None
    for name in args.schemes.split(","):
        state["key"] = None if name == "none" else key_scheme(name, stats, cfg.head_dim)
        t0 = time.perf_counter()
        ppl = perplexity(ids)
        baseline = baseline or ppl
        print(
            f"| {name} | {ppl:.4f} | {100 * (ppl / baseline - 1):+.2f}% | {time.perf_counter() - t0:.0f} |", flush=True
        )


if __name__ == "__main__":
    main()
