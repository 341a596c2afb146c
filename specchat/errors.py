"""Errors a user can cause. The CLI prints them as one line and exits nonzero; anything else is our bug."""

from __future__ import annotations

import logging
from pathlib import Path


class SpecchatError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""


class ModelNotFoundError(SpecchatError):
    """An unknown alias, or a path that does not exist."""


class ModelFormatError(SpecchatError):
    """A model file that is missing pieces, truncated, of an unsupported architecture or of the wrong shape."""


class OfflineError(SpecchatError):
    """A model is not cached and cannot be fetched."""


class ConfigError(SpecchatError):
    """An invalid parameter (sampling, speculation, engine settings). `ConfigError.of` keeps which field it was and
    what is wrong with it apart, so a caller whose user spells the field otherwise (an agent script's
    `sampling.max_tokens`) can name it that way."""

    field: str | None = None
    problem: str | None = None

    @classmethod
    def of(cls, field: str, problem: str) -> ConfigError:
        """ "<field as the CLI flag spells it> <problem>", e.g. `ConfigError.of("max_tokens", "must be > 0")`."""
        error = cls(f"{field.replace('_', '-')} {problem}")
        error.field, error.problem = field, problem
        return error


class PromptError(SpecchatError):
    """An empty prompt, or a prompt that does not fit the context."""


class ContextLengthError(PromptError):
    """A prompt longer than the model's context (the server's `context_length_exceeded`, which clients such as
    LiteLLM read to shorten a conversation)."""


class KVCacheFullError(SpecchatError):
    """The KV pool cannot hold a request even when it runs alone."""


def path_problem(path: Path, shown: str, directory: bool = False) -> str | None:
    """Why `path` is not the file (`directory`: the folder) a setting names, in words with `shown` for the path;
    None where it is."""
    if directory:
        if path.is_dir():
            return None
        return f"{shown} is a file, not a directory" if path.exists() else f"no such directory {shown}"
    if path.is_file():
        return None
    return f"{shown} is a directory, not a file" if path.is_dir() else f"no such file {shown}"


def note_not_saved(log: logging.Logger, path: Path, exc: Exception) -> None:
    """The one note for a cache the load could not write (a read-only or full disk, a file where its folder should
    be): the load goes on without it, and only the next one does the work again."""
    log.warning("specchat: note: cannot save %s (%s); loading without it", path, exc)
