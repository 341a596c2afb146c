"""Tokenizer, chat template and streaming detokenization.

At run time we use the `tokenizers` library on a `tokenizer.json` plus the model's Jinja chat template,
rendered the way HF transformers renders it (sandboxed Jinja, trim_blocks / lstrip_blocks, `tojson`,
`raise_exception`, `strftime_now`). A GGUF file carries its vocabulary, merges and template in metadata;
`gguf_tokenizer` converts them once into such a directory (a byte-level BPE vocabulary directly,
`byte_level_bpe`; any other through transformers' GGUF converter), and again if that copy is damaged.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from specchat.engine.prompt_bound import byte_level_chars
from specchat.errors import ModelFormatError, PromptError, note_not_saved
from specchat.registry import ModelSpec, tokenizer_dir
from specchat.safetensors_io import read_json_object

# End-of-turn markers of common chat templates; those present in a vocabulary stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "</s>")
CONVERTED_FILES = ("tokenizer.json", "tokenizer_config.json")  # a whole conversion has both (save_pretrained)

log = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_template(file: Path) -> str:
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{file}: not valid UTF-8 (at byte {exc.start})") from None


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode / decode plus the model's chat template and stop tokens."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self._bytes = _byte_table(backend)  # (at load: ~40 ms for a 49k vocabulary, not on a first request)
        self.chat_template_source = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.bos_token, self.eos_token = bos_token, eos_token
        stop = set(extra_eos_ids)
        for text in (eos_token, *END_OF_TURN_TOKENS):
            tid = backend.token_to_id(text) if text else None
            if tid is not None:
                stop.add(tid)
        self.stop_token_ids = frozenset(stop)

    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from an HF-style directory."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFormatError(f"{path}: no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises plain Exceptions on bad files
            raise ModelFormatError(f"{tok_file}: cannot read tokenizer ({exc})") from None
        config_file, template_file = path / "tokenizer_config.json", path / "chat_template.jinja"
        config = read_json_object(config_file) if config_file.is_file() else {}
        template, origin = config.get("chat_template"), config_file
        if isinstance(template, list):  # named templates: take the default one
            named = (t for t in template if isinstance(t, dict) and t.get("name") == "default")
            template = next((t.get("template") for t in named), None)
        if template_file.is_file():
            template, origin = _read_template(template_file), template_file
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"{origin}: chat_template must be a string, got {type(template).__name__}")
        specials = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        for key, text in specials.items():
            if text is not None and not isinstance(text, str):
                raise ModelFormatError(f"{config_file}: {key} must be a string, got {text!r}")
        try:
            return cls(backend, template, specials["bos_token"], specials["eos_token"], extra_eos_ids)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelFormatError(f"{origin}: invalid chat template (line {exc.lineno}: {exc.message})") from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: from "\ud800" in JSON, or undecodable bytes
            raise PromptError(
                f"the prompt is not valid Unicode text: it holds a lone surrogate {text[exc.start]!r} (bytes that are "
                f"not UTF-8, or an unpaired \\ud800-\\udfff escape)"
            ) from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self, prompt_ids: list[int]) -> StreamDecoder | ByteStreamDecoder:
        """A decoder of the text that tokens after `prompt_ids` add, as they come (special tokens skipped)."""
        return StreamDecoder(self, prompt_ids) if self._bytes is None else ByteStreamDecoder(self._bytes)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The chat template applied to messages, as text."""
        if self._template is None:
            raise PromptError("this model has no chat template; use --raw to send the prompt as is")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as exc:
            raise PromptError(f"the chat template rejected these messages: {exc}") from None
        except Exception as exc:  # the template is the model's code: whatever it raises is the model file's fault
            raise ModelFormatError(f"the chat template failed ({type(exc).__name__}: {exc})") from None

    def encode_chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        # The rendered template already holds the BOS token where the model wants one.
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


def _byte_table(backend: HFTokenizer) -> list[bytes] | None:
    """Each token id's bytes, where the tokenizer decodes by GPT-2's byte-level mapping (a ByteLevel decoder, no
    added token but special ones, which decoding skips): then the text of any ids is their bytes joined, read as
    UTF-8. None for any other tokenizer (SentencePiece's spaces, byte fallback...)."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()
    if any(not token.special for token in added.values()):
        return None
    to_byte = {char: b for b, char in byte_level_chars().items()}
    vocab = {token: i for token, i in backend.get_vocab(with_added_tokens=False).items() if i not in added}
    if not set("".join(vocab)) <= to_byte.keys():  # a token outside the byte alphabet: not byte-level after all
        return None
    latin1 = {ord(c): b for c, b in to_byte.items()}  # each character to the code point of its byte
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for token, i in vocab.items():
        table[i] = token.translate(latin1).encode("latin-1")
    return table


class ByteStreamDecoder:
    """StreamDecoder for byte-level tokenizers (`_byte_table`): each new token's bytes into one incremental UTF-8
    decoder, which holds back an incomplete character by itself. The same text as decoding the ids whole, for a
    fraction of the host time: two decodes per request a step were ~12% of a drafting step's host work at 32
    sessions (benchmarks/host_loop.py)."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, new_ids: list[int]) -> str:
        table = self.table
        try:
            data = b"".join([table[i] for i in new_ids])
        except IndexError:  # an id past the tokenizer's vocabulary (a model's padded rows): no text, as decode
            data = b"".join([table[i] for i in new_ids if 0 <= i < len(table)])
        return self.utf8.decode(data)

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decoding tokens one by one loses leading spaces (SentencePiece) and breaks multi-byte characters split
    across tokens. So we decode a short window that starts a few tokens back and emit only the new part,
    holding back text that ends in an incomplete character (U+FFFD).
    """

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def gguf_tokenizer(gguf_path: Path, folder: Path) -> Tokenizer:
    """The tokenizer of a GGUF file: converted once into `folder` (its derived cache), read from there after. A
    cached conversion that is incomplete or does not load is converted again, with a note on stderr."""
    if folder.exists():
        try:
            return _read_conversion(folder)
        except (ModelFormatError, OSError) as exc:
            log.warning("specchat: note: %s; converting the tokenizer again from %s", exc, gguf_path.name)
    return export_gguf_tokenizer(gguf_path, folder)


def _read_conversion(folder: Path) -> Tokenizer:
    for name in CONVERTED_FILES:
        if not (folder / name).is_file():
            raise ModelFormatError(f"{folder}: the converted tokenizer lacks {name}")
    return Tokenizer.from_dir(folder)


def export_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> Tokenizer:
    """Convert a GGUF file's tokenizer metadata into tokenizer.json + config + chat template in out_dir, and load it.

    Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": SmolLM, Llama 3, Qwen 2) of a known pre-tokenizer
    are built directly (`byte_level_bpe`, ~0.5 s for the default model); every other one goes through transformers'
    GGUF converter (the default model took 8.2 s there, mostly importing transformers and parsing the file again).

    The files are written into a fresh folder beside out_dir, which then takes out_dir's place: out_dir is a whole
    conversion or absent, whatever happens to the process meanwhile. Where out_dir cannot be written (a read-only
    cache, a file where its folder should be, a full disk) the conversion goes to a temporary folder instead, with a
    note: the model loads, only the next load converts again.
    """
    from specchat.engine.loader import gguf_reader

    direct = byte_level_bpe(gguf_reader(gguf_path))
    save = direct.save if direct is not None else _transformers_conversion(gguf_path).save_pretrained
    try:
        _save_conversion(save, out_dir)
    except OSError as exc:
        note_not_saved(log, out_dir, exc)
        with tempfile.TemporaryDirectory(prefix="specchat-tokenizer-") as scratch:
            save(scratch)
            return Tokenizer.from_dir(Path(scratch))  # read whole into memory: the folder may go
    return Tokenizer.from_dir(out_dir)


def _transformers_conversion(gguf_path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many kinds of errors for unsupported GGUF tokenizers
        raise ModelFormatError(f"{gguf_path}: cannot convert the GGUF tokenizer ({exc})") from None


# How `tokenizer.ggml.pre` splits text before the byte-level BPE: the pre-tokenizers whose split is GPT-2's own (the
# ByteLevel pre-tokenizer's regex), and the others by their pattern (Llama 3's from Meta's tiktoken model, Qwen 2's
# from its tokenizer.json). A pre-tokenizer named in neither goes through transformers' converter.
GPT2_SPLIT = frozenset({None, "default", "gpt-2", "smollm"})
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


class ByteLevelConversion:
    """A byte-level BPE tokenizer built from GGUF metadata, and what its tokenizer_config.json and chat template say;
    `save(folder)` writes the three files Tokenizer.from_dir reads."""

    def __init__(self, backend: HFTokenizer, config: dict, template: str | None) -> None:
        self.backend, self.config, self.template = backend, config, template

    def save(self, folder) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_text(self.backend.to_str(), encoding="utf-8")  # (OSError on a full disk)
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        if self.template is not None:
            (folder / "chat_template.jinja").write_text(self.template, encoding="utf-8")


def byte_level_bpe(gguf) -> ByteLevelConversion | None:
    """The tokenizer a GGUF file's `gpt2` vocabulary describes (None for any other kind, or an unknown
    pre-tokenizer), built as transformers' GGUF converter builds it: the same vocabulary (a token outside the byte
    alphabet respelled from its UTF-8 bytes), merges, split, added tokens (control ones special, user-defined ones
    whole) and BOS / EOS template, so both encode every text alike (tests/engine/test_gguf_tokenizer.py)."""
    from tokenizers import AddedToken, Regex, models, pre_tokenizers, processors

    pre = gguf.get("tokenizer.ggml.pre")
    tokens, merges = gguf.get("tokenizer.ggml.tokens"), gguf.get("tokenizer.ggml.merges")
    if gguf.get("tokenizer.ggml.model") != "gpt2" or not (pre is None or isinstance(pre, str)):
        return None
    if pre not in GPT2_SPLIT and pre not in SPLITS:
        return None
    if not all(isinstance(x, list) and all(isinstance(t, str) for t in x) for x in (tokens, merges)):
        return None  # (transformers' converter says what is wrong with them)
    chars = byte_level_chars()
    alphabet = set(chars.values())
    vocab = {
        token if set(token) <= alphabet else "".join(chars[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ")) for merge in merges]
    try:
        backend = HFTokenizer(
            models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
    except Exception as exc:  # the tokenizers library raises plain Exceptions (a merge of tokens not in the vocabulary)
        raise ModelFormatError(f"{gguf.path}: cannot build the GGUF tokenizer ({exc})") from None
    if pre in SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    types = gguf.get("tokenizer.ggml.token_type") or []
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    ids = backend.get_vocab(with_added_tokens=True)  # (the user-defined tokens below are in it already: same ids)
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in ids]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    special = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        tid = gguf.get(f"tokenizer.ggml.{key}_token_id")
        special[name] = tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None
    add = {end: bool(gguf.get(f"tokenizer.ggml.add_{end}_token")) and special[end] in ids for end in ("bos", "eos")}

    def sequence(piece: str, type_id: int) -> str:  # [BOS] piece [EOS], as the file asks
        return " ".join(
            [*([f"{special['bos']}:{type_id}"] if add["bos"] else []), f"{piece}:{type_id}"]
            + ([f"{special['eos']}:{type_id}"] if add["eos"] else [])
        )

    single, pair = sequence("$A", 0), f"{sequence('$A', 0)} {sequence('$B', 1)}"
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(special[end], ids[special[end]]) for end in ("bos", "eos") if add[end]],
    )
    config = {f"{name}_token": text for name, text in special.items()}
    config.update(add_bos_token=add["bos"], add_eos_token=add["eos"], tokenizer_class="PreTrainedTokenizerFast")
    template = gguf.get("tokenizer.chat_template")
    return ByteLevelConversion(backend, config, template if isinstance(template, str) else None)


def _save_conversion(save, out_dir: Path) -> None:
    """`save(folder)` into a staging folder beside out_dir, which then becomes out_dir (see export_gguf_tokenizer)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".part"))
    try:
        save(str(staging))
        _replace_folder(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_folder(new: Path, target: Path) -> None:
    """Put folder `new` where `target` is. If another process puts its own conversion there first, theirs stays:
    both are conversions of the same file."""
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    with contextlib.suppress(FileNotFoundError):  # no old folder, or another process moved it already
        target.rename(old)
    with contextlib.suppress(OSError):  # ENOTEMPTY / EEXIST: another process won
        new.rename(target)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:  # a file or a link where the folder was (a link goes, never what it points to)
        old.unlink(missing_ok=True)


def load_tokenizer(spec: ModelSpec, model_path: Path) -> Tokenizer:
    """The tokenizer of an HF directory, or the one converted (once, then cached) from a GGUF file. (Here, not in
    engine/loading.py, so that `specchat pull` checks a model's tokenizer without importing torch: 1.9 s.)"""
    folder = tokenizer_dir(spec, model_path)
    if model_path.is_file():
        return gguf_tokenizer(model_path, folder)
    return Tokenizer.from_dir(folder)
