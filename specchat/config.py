"""Validated settings passed down explicitly: sampling, speculation and the engine."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

from specchat.errors import ConfigError

# The one list of each name; the CLI, the UI, agent scripts, the engine and its error messages all read these.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)  # auto = bfloat16 on CUDA and on CPUs with native bf16, else float32
HF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # config.json model_type values the model code implements
DEVICES = ("auto", "cpu", "cuda")
KV_FORMATS = ("bf16", "fp16", "fp32", "mxfp4", "k8v4")  # KV page formats (engine.kv_pages)
KV_CHOICES = ("auto", *KV_FORMATS)  # auto = the model dtype's dense format (fp16 under the CPU attention kernel)
WEIGHT_FORMATS = ("bf16", "mxfp4")  # bf16 = unquantized, in the model dtype (quant.handler)
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)  # auto = as the checkpoint stores them
# activation rows of the CPU block kernels (engine.cpu_weights.set_activations); auto: int8 where the CPU block
# kernels run and the CPU has AVX512-VNNI or AVX2, fp32 elsewhere
CPU_ACTIVATIONS = ("auto", "fp32", "int8")
# Drafters by kind (engine.drafters.make_drafter builds them); `default` names the model's models.toml drafter.
DRAFTERS = ("none", "ngram", "heads", "ngram+heads", "eagle", "draft-model")
DRAFTER_ARGS = {"heads": "FILE", "ngram+heads": "FILE", "eagle": "DIR", "draft-model": "NAME"}  # take `kind:ARG`
DRAFTER_CHOICES = (*DRAFTERS, "default")
DRAFTER_SYNTAX = " | ".join(f"{d}[:{DRAFTER_ARGS[d]}]" if d in DRAFTER_ARGS else d for d in DRAFTER_CHOICES)
SEED_MAX = (1 << 64) - 1  # torch.Generator.manual_seed takes a 64-bit seed
WHOLE_HEAD_DRAFTERS = ("heads", "ngram+heads")  # they read rows of the target's whole output head (not under --tp)
# `specchat quantize` (quant.quantize): its methods, the MXFP4 block scale rules (kernels.mxfp4) and its defaults
QUANT_METHODS = ("gptq", "rtn")
DEFAULT_QUANT_METHOD = "gptq"
MXFP4_RULES = ("ocp", "roundup", "mse")
DEFAULT_QUANT_RULE = "mse"
DEFAULT_QUANT_LAYERS = "all"  # layer selection (quant.modules)
CALIBRATION_TOKENS = 8192  # all 6,569 tokens of the shipped text: better than 2,048 on the dev text (benchmarks.md)
DEFAULT_DAMP = 0.01  # GPTQ: fraction of mean(diag(H)) added to the diagonal


KIND_NAMES = {str: "a string", bool: "True or False", int: "an integer"}


def is_number(value: object, integer: bool = False) -> bool:
    """Whether an API caller's value is a number (an int where `integer`), not a bool or a string."""
    kinds = (int,) if integer else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


def check_drafter_name(name: str) -> str:
    """`name` if it is a drafter kind, or `kind:ARG` for a kind that takes one; ConfigError otherwise."""
    kind, sep, arg = name.partition(":")
    if kind not in DRAFTER_CHOICES or (sep and (kind not in DRAFTER_ARGS or not arg)):
        raise ConfigError.of("drafter", f"unknown drafter {name!r} (available: {DRAFTER_SYNTAX})", alone=True)
    return name


# A positive temperature this small divides the logits past float32's range (1e-300 is 0 there): the sampler's
# probabilities came out NaN and the engine step failed, ending every request of the batch with that error. Below
# it, sampling is greedy, as in vLLM (its _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How tokens are chosen. A temperature of 0 (or below GREEDY_BELOW) means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            if not is_number(getattr(self, name)):
                raise ConfigError.of(name, f"must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "max_tokens"):
            if not is_number(getattr(self, name), integer=True):
                raise ConfigError.of(name, f"must be an integer, got {getattr(self, name)!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError.of("stop", f"must be a list of strings, got {self.stop!r}")
        if "" in self.stop:
            refused = "an empty stop text is refused (it is found at once, so every answer would end empty)"
            raise ConfigError.of("stop", refused, alone=True)
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ConfigError.of("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError.of("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError.of("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ConfigError.of("max_tokens", f"must be > 0, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ConfigError.of("seed", f"must be in [0, 2^64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


K_MAX_LIMIT = 16  # the largest k_max a SpecParams takes


@dataclass(slots=True)
class SpecParams:
    """Speculation for one request: which drafter proposes and how many tokens (k) per step.

    k = None (the default, as the CLI's `--k auto`) means adaptive: a controller picks k in [0, k_max] from the
    acceptance it sees and the step times it measures.
    """

    drafter: str = "none"
    k: int | None = None
    k_max: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.k_max <= K_MAX_LIMIT:  # first: k_max is k's bound (k_max = -1 read "k must be in [0, -1]")
            raise ConfigError.of("k_max", f"must be in [0, {K_MAX_LIMIT}], got {self.k_max}", shown="k_max")
        if self.k is not None and not 0 <= self.k <= self.k_max:
            raise ConfigError.of("k", f"must be in [0, {self.k_max}] or 'auto', got {self.k}")


@dataclass(slots=True)
class EngineConfig:
    """How the engine loads and runs a model."""

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str | None = None  # None or "auto": bfloat16 on CUDA and on CPUs with native bf16, else float32
    kv_format: str = "auto"  # "auto" = the model dtype
    kv_rotation: bool = True  # Hadamard-rotate keys/values before quantizing them (mxfp4, k8v4)
    kv_key_transform: bool = True  # mxfp4 pages: the calibrated key transform before the rotation (kv_transform)
    kv_memory: int | None = None  # bytes for the KV pool; None = a default for the device
    page_size: int = 16
    max_batch_tokens: int = 2048
    max_running: int = 64
    eager: bool = False  # plain PyTorch modules: no CUDA graphs, no CPU block kernels (the reference path)
    warm_up: bool = True  # CUDA: compile kernels and capture the chat's graphs at load (Engine.warm_up)
    weights: str = "auto"  # "auto" = as loaded
    tp: int = 1  # tensor-parallel ranks: the model split over this many GPUs (CPU processes on the CPU)
    cpu_act: str = "auto"  # CPU GGUF-block linears: float32 rows, or int8 per block of 32 (AVX512-VNNI or AVX2)

    FIELD_KINDS: ClassVar[dict[str, type]] = {
        "model": str, "device": str, "dtype": str, "kv_format": str, "kv_rotation": bool, "kv_key_transform": bool,
        "page_size": int, "max_batch_tokens": int, "max_running": int, "eager": bool, "warm_up": bool,
        "weights": str, "tp": int, "cpu_act": str,
    }  # fmt: skip

    @property
    def chosen_device(self) -> str | None:
        """The device type the config names ("cpu" | "cuda"), None for "auto" (known once the model is loaded)."""
        return None if self.device == "auto" else self.device

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a local model's path
            self.model = os.fspath(self.model)
        for name, kind in EngineConfig.FIELD_KINDS.items():  # the API's callers, before any comparison raises
            value = getattr(self, name)
            if name == "dtype" and value is None:
                continue
            ok = is_number(value, integer=True) if kind is int else isinstance(value, kind)
            if not ok:
                raise ConfigError(f"{name} must be {KIND_NAMES[kind]}, got {value!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page size must be a power of two, got {self.page_size}")
        if self.kv_format not in KV_CHOICES:
            raise ConfigError(f"kv format must be one of {', '.join(KV_CHOICES)}, got {self.kv_format!r}")
        if self.max_running <= 0:
            raise ConfigError(f"max-running must be > 0, got {self.max_running}")
        if self.max_batch_tokens <= 0:
            raise ConfigError(f"max batch tokens must be > 0, got {self.max_batch_tokens}")
        if self.kv_memory is not None and not (is_number(self.kv_memory) and 0 < self.kv_memory < math.inf):
            raise ConfigError(f"kv memory must be a number of bytes > 0, got {self.kv_memory!r}")
        if self.weights not in WEIGHT_CHOICES:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {self.weights!r}")
        if self.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")
        if self.cpu_act not in CPU_ACTIVATIONS:
            raise ConfigError(f"cpu-act must be one of {', '.join(CPU_ACTIVATIONS)}, got {self.cpu_act!r}")
        if self.cpu_act == "int8" and (self.device == "cuda" or self.eager or self.tp > 1):
            why = "--device cuda" if self.device == "cuda" else "--eager" if self.eager else "--tp > 1"
            raise ConfigError(f"--cpu-act {self.cpu_act} needs the CPU block kernels, which {why} does not use")
