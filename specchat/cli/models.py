"""`specchat models` lists the registry; `specchat pull` fetches a model ahead of time."""

from __future__ import annotations

import logging

import click

from specchat.cli.options import StderrProgress, check_model_name

log = logging.getLogger(__name__)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "?"


@click.command()
def models() -> None:
    """List model aliases, where they come from, their size and whether they are present locally."""
    from specchat.registry import disk_size, load_registry, local_path

    specs, default = load_registry()
    rows = []
    for alias, spec in specs.items():
        path = local_path(spec)
        size = disk_size(path) if path else spec.size
        name = f"{alias} (default)" if alias == default else alias
        rows.append((name, spec.where, human_bytes(size), "yes" if path else "no", spec.description))
    headers = ("alias", "source", "size", "local", "description")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    click.echo(fmt.format(*headers))
    for row in rows:
        click.echo(fmt.format(*row))


@click.command()
@click.argument("name", required=False, callback=check_model_name)
def pull(name: str | None) -> None:
    """Fetch model NAME (default: smollm2-135m) into the cache ahead of time."""
    from specchat.errors import ModelFormatError
    from specchat.registry import download_intact, fetch, is_download, refetch, resolve

    spec = resolve(name)
    path = fetch(spec, progress=StderrProgress())
    try:
        if is_download(spec, path) and not download_intact(path):
            raise ModelFormatError(f"{path}: its bytes differ from those downloaded (a damaged copy)")
        check_model_file(spec, path)
    except ModelFormatError as exc:  # our own download, damaged since (a size-preserving corruption): fetched again
        if not is_download(spec, path):
            raise
        log.warning("specchat: note: %s; downloading %s again", exc, spec.alias)
        path = refetch(spec, progress=StderrProgress())
        check_model_file(spec, path)
    click.echo(f"{spec.alias}: {path}")


def check_model_file(spec, path) -> None:
    """A GGUF file's header and tensor table read, and its tokenizer (ModelFormatError where damaged): a tokenizer
    converted earlier is read from its cache, which would not see the file."""
    from specchat.engine.tokenizer import load_tokenizer

    if path.is_file() and path.suffix.lower() == ".gguf":
        from specchat.engine.gguf_file import GGUFFile

        GGUFFile(path)
    load_tokenizer(spec, path)


def register(group: click.Group) -> None:
    group.add_command(models)
    group.add_command(pull)
