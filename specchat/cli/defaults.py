"""`$SPECCHAT_HOME/config.toml`: the user's defaults for `specchat run`, below the command line and above ours.

    model = "smollm2-135m"      # a models.toml alias, a path or an org/name hub id
    drafter = "ngram"           # any --drafter value
    k = 4                       # or "auto"
    weights = "mxfp4"           # auto | bf16 | mxfp4
    kv = "k8v4"                 # auto | bf16 | fp16 | fp32 | mxfp4 | k8v4
    temperature = 0.7
    theme = "nord"              # a Textual theme (the palette's "Change theme" lists them)
    system = "Answer briefly."  # the system prompt of new chats

Every key is optional. A flag given on the command line wins over the file. A mistake in the file (TOML syntax, an
unknown key, a value of the wrong type or out of range) ends `run` in one line naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import click
from click.core import ParameterSource

from specchat.cli.options import check_drafter_arg
from specchat.config import KV_CHOICES, WEIGHT_CHOICES, SamplingParams, SpecParams
from specchat.errors import ConfigError, ModelNotFoundError, SpecchatError, path_problem
from specchat.registry import cache_dir, read_toml, resolve

# a key of the file -> the `run` parameter it stands in for (theme has no flag)
PARAMETERS = {
    "model": "model",
    "drafter": "drafter",
    "k": "k",
    "weights": "weights",
    "kv": "kv_format",
    "temperature": "temperature",
    "system": "system",
}


@dataclass(slots=True)
class RunDefaults:
    """The file's settings; None = not set. Checked as they are made, each error naming its key."""

    model: str | None = None
    drafter: str | None = None
    k: int | str | None = None  # an integer, or "auto"
    weights: str | None = None
    kv: str | None = None
    temperature: float | None = None
    theme: str | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        for key in ("model", "drafter", "weights", "kv", "theme", "system"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{key} must be a string, got {value!r}")
        if self.model is not None:
            resolve_model(self.model)
        if self.drafter is not None:
            check_drafter_arg(self.drafter, setting="drafter")  # its file too: not blamed on a --drafter flag later
        if self.k is not None:
            check_k(self.k)
        for key, choices in (("weights", WEIGHT_CHOICES), ("kv", KV_CHOICES)):
            value = getattr(self, key)
            if value is not None and value not in choices:
                raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
        if self.temperature is not None:
            if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
                raise ConfigError(f"temperature must be a number, got {self.temperature!r}")
            SamplingParams(temperature=float(self.temperature))
        if self.theme is not None:
            check_theme(self.theme)

    def flag_value(self, key: str) -> object:
        """The value as its command-line flag would give it (k and temperature as text and float)."""
        value = getattr(self, key)
        return str(value) if key == "k" else float(value) if key == "temperature" else value


def resolve_model(name: str) -> None:
    """The model names something (an alias, a path that exists, a hub id); resolving touches no network. An empty
    name is a mistake, as the MODEL argument's is: `run` took it for the default model, silently."""
    if not name.strip():
        raise ConfigError("model is empty: leave the key out for the default model, or see `specchat models`")
    try:
        resolve(name)
    except ModelNotFoundError as exc:
        raise ConfigError(f"model: {exc}") from None


def check_k(k: object) -> None:
    if k == "auto":
        return
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"k must be an integer or 'auto', got {k!r}")
    SpecParams(drafter="none", k=k)


def check_theme(theme: str) -> None:
    from textual.theme import BUILTIN_THEMES

    if theme not in BUILTIN_THEMES:
        raise ConfigError(f"theme must be one of {', '.join(sorted(BUILTIN_THEMES))}, got {theme!r}")


def defaults_path() -> Path:
    return cache_dir() / "config.toml"


def load_defaults(path: Path | None = None) -> RunDefaults:
    """The defaults file (none: no defaults); a ConfigError naming the file and the key for any mistake in it."""
    path = path or defaults_path()
    if not path.exists():
        return RunDefaults()
    if (problem := path_problem(path, str(path))) is not None:  # a folder or a FIFO there was ignored silently
        raise ConfigError(f"{problem}: the defaults file must be a TOML file")
    data = read_toml(path)
    known = [f.name for f in fields(RunDefaults)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    for key in known:  # one at a time, so the error names the key
        if key in data:
            try:
                RunDefaults(**{key: data[key]})
            except SpecchatError as exc:  # a ConfigError, or the ModelNotFoundError of a draft-model:NAME
                message = str(exc)
                raise ConfigError(f"{path}: {message if message.startswith(key) else f'{key}: {message}'}") from None
    return RunDefaults(**data)


def apply_defaults(ctx: click.Context, defaults: RunDefaults, params: dict) -> dict:
    """`run`'s parameters, each one the command line did not give taken from the defaults where they set it."""
    merged = dict(params)
    for key, name in PARAMETERS.items():
        if getattr(defaults, key) is None:
            continue
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        merged[name] = defaults.flag_value(key)
    return merged
