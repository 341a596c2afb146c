"""A calibrated key transform for MXFP4 KV pages: keys times A, queries times A^-T, per layer and KV head.

Scores are unchanged in exact arithmetic, (q A^-T)(k A)^T = q k^T; only what the quantizer sees changes. A is
chosen so that an isotropic quantization error of the transformed keys moves the scores least: it minimises
tr(A^T Sk A) tr(A^-1 Sq A^-T) (Sk, Sq the second moments of the keys and of the queries of a KV head), whose
minimiser has A A^T = Sk^-1 # Sq, the matrix geometric mean, taken here as A = (Sk^-1 # Sq)^(1/2) (symmetric).
The page store applies its Hadamard rotation after A (kv_pages.PageStore). The moments come from one forward
over the calibration text (specchat/data/text/calibration_heapq.txt, never a held-out one), with the model's
weights as loaded, and the result is cached in the model's derived folder. Screening and measurements:
benchmarks/kv_key_transforms.py and docs/benchmarks.md ("Key transforms before MXFP4 KV quantization").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open

from specchat.kernels.attention import causal_attention
from specchat.registry import derived_dir
from specchat.safetensors_io import save_tensors

CALIBRATION_TEXT = "calibration_heapq.txt"
WINDOWS, CONTEXT = 2, 1024  # calibration tokens: the first WINDOWS windows of CONTEXT tokens
EPS = 1e-3  # each second moment gets EPS times its mean eigenvalue added (keeps A finite on unused directions)
VERSION = 1
FILE_NAME = f"kv_key_transform-v{VERSION}.safetensors"


def psd_power(a: torch.Tensor, p: float) -> torch.Tensor:
    """a^p of a symmetric positive semi-definite matrix (float64), eigenvalues clamped away from zero."""
    w, v = torch.linalg.eigh(a.double())
    return (v * w.clamp(min=1e-12) ** p) @ v.T


def geometric_transform(sk: torch.Tensor, sq: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """A [D, D] (float64, symmetric) with A A^T = Sk^-1 # Sq = Sk^-1/2 (Sk^1/2 Sq Sk^1/2)^1/2 Sk^-1/2."""
    eye = torch.eye(sk.shape[-1], dtype=torch.float64)
    sk = sk.double() + eps * sk.trace().double() / len(eye) * eye
    sq = sq.double() + eps * sq.trace().double() / len(eye) * eye
    root, inv_root = psd_power(sk, 0.5), psd_power(sk, -0.5)
    return psd_power(inv_root @ psd_power(root @ sq @ root, 0.5) @ inv_root, 0.5)


class _Moments:
    """A KVAttention that attends plainly over one window and sums each layer's key and query second moments."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.scale = scale
        shape = (num_layers, num_kv_heads, head_dim, head_dim)
        self.sk = torch.zeros(shape, dtype=torch.float64)
        self.sq = torch.zeros(shape, dtype=torch.float64)
        self.nk = self.nq = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kh = k.detach().double().transpose(0, 1).cpu()  # [KVH, T, D]
        qh = q.detach().double().unflatten(1, (k.shape[1], -1)).permute(1, 0, 2, 3).flatten(1, 2).cpu()
        self.sk[layer] += kh.transpose(1, 2) @ kh
        self.sq[layer] += qh.transpose(1, 2) @ qh
        if layer == 0:
            self.nk += kh.shape[1]
            self.nq += qh.shape[1]
        return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), self.scale)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, encode: Callable[[str], list[int]], text: str | None = None) -> torch.Tensor:
    """A [layers, KVH, D, D] (float32) from one forward over the calibration text's first windows."""
    cfg = model.cfg
    if text is None:
        text = resources.files("specchat").joinpath("data", "text", CALIBRATION_TEXT).read_text()
    ids = encode(text)[: WINDOWS * CONTEXT]
    moments = _Moments(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    device = next(model.parameters()).device
    for lo in range(0, len(ids), CONTEXT):
        window = torch.tensor(ids[lo : lo + CONTEXT], device=device)
        model(
            window,
            torch.arange(len(window), device=device),
            moments,
            logits_at=torch.tensor([len(window) - 1], device=device),
        )
    sk, sq = moments.sk / moments.nk, moments.sq / moments.nq
    out = torch.empty(sk.shape, dtype=torch.float32)
    for layer in range(sk.shape[0]):
        for head in range(sk.shape[1]):
            out[layer, head] = geometric_transform(sk[layer, head], sq[layer, head]).float()
    return out


def cache_path(model_path: Path, weights: str) -> Path:
    """Where the transform of MODEL (calibrated with these weights) is cached: its derived folder."""
    return derived_dir(model_path) / f"{weights}-{FILE_NAME}"


def load_or_calibrate(
    model: torch.nn.Module, encode: Callable[[str], list[int]], model_path: Path, weights: str
) -> torch.Tensor:
    """The cached transform of this model, or a fresh calibration (then cached)."""
    path = cache_path(model_path, weights)
    text = resources.files("specchat").joinpath("data", "text", CALIBRATION_TEXT).read_text()
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    if path.is_file():
        try:
            with safe_open(path, "pt") as f:
                if (f.metadata() or {}).get("text") == digest:
                    transform = f.get_tensor("transform")
                    if transform.shape == shape:
                        return transform
        except Exception:  # an unreadable cache is made again
            pass
    transform = calibrate(model, encode, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two processes calibrating at once each write whole
    save_tensors({"transform": transform.contiguous()}, tmp, metadata={"text": digest})
    tmp.replace(path)
    return transform
