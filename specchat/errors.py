"""Errors a user can cause. The CLI prints them as one line and exits nonzero; anything else is our bug."""

from __future__ import annotations

import errno
import logging
import stat
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
    alone: bool = False  # the problem is a whole sentence, which a spelling of the field goes before as "shown: "

    @classmethod
    def of(cls, field: str, problem: str, shown: str | None = None, alone: bool = False) -> ConfigError:
        """ "<field as the CLI flag spells it> <problem>", e.g. `ConfigError.of("max_tokens", "must be > 0")`;
        `shown` spells a field that no flag sets (`k_max`). `alone`: the problem reads without the field ("unknown
        drafter 'x' (available: ...)"), and is the message until a spelling names it ("--drafter: unknown ...")."""
        if alone:
            error = cls(f"{shown}: {problem}" if shown else problem)
        else:
            error = cls(f"{shown or field.replace('_', '-')} {problem}")
        error.field, error.problem, error.alone = field, problem, alone
        return error

    def named(self, shown: str) -> ConfigError:
        """This error with its field spelt `shown` (`--k`, `/k`, `sampling.max_tokens`); itself where it names none."""
        if self.field is None or self.problem is None:
            return self
        return ConfigError.of(self.field, self.problem, shown, self.alone)


class PromptError(SpecchatError):
    """An empty prompt, or a prompt that does not fit the context."""


class ContextLengthError(PromptError):
    """A prompt longer than the model's context (the server's `context_length_exceeded`, which clients such as
    LiteLLM read to shorten a conversation)."""


class KVCacheFullError(SpecchatError):
    """The KV pool cannot hold a request even when it runs alone."""


# What a path is, by the type bits of its mode, for "X is a FIFO, not a regular file".
FILE_KINDS = (
    (stat.S_ISREG, "a file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def path_problem(path: Path, shown: str, directory: bool = False) -> str | None:
    """Why `path` is not the regular file (`directory`: the folder) a setting names, in words with `shown` for the
    path; None where it is. A FIFO or a device (/dev/stdin on a terminal) is no file to read a setting from: the read
    waits on whoever writes it, or never ends."""
    try:
        mode = path.stat().st_mode  # follows links: /dev/stdin is whatever stdin is
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path, which names nothing
        if isinstance(error, ValueError) or error.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"no such {'directory' if directory else 'file'} {shown}"
        return f"cannot read {shown} ({error.strerror or error})"
    if stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode):
        return None
    kind = next((name for is_kind, name in FILE_KINDS if is_kind(mode)), "a special file")
    wanted = "a directory" if directory else "a file" if stat.S_ISDIR(mode) else "a regular file"
    return f"{shown} is {kind}, not {wanted}"


def note_not_saved(log: logging.Logger, path: Path, exc: Exception) -> None:
    """The one note for a cache the load could not write (a read-only or full disk, a file where its folder should
    be): the load goes on without it, and only the next one does the work again."""
    log.warning("specchat: note: cannot save %s (%s); loading without it", path, exc)
