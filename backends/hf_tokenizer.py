"""A GGUF vocabulary as HF tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``).

What ``zoomr finetune`` exports next to its merged weights, so the fine-tuned model loads as a HF directory
(:class:`zoomr.backends.tokenizer.HFTokenizer`), with extra special tokens (the summary delimiters) appended
to the vocabulary. Byte-level BPE (``tokenizer.ggml.model`` = ``gpt2``) with a pre-tokenizer whose rules are
known here; anything else is refused rather than converted approximately: a tokenizer that splits text
differently from the one the model was trained with silently degrades it.

Source: llama.cpp's ``convert_hf_to_gguf.py`` (which fields a HF tokenizer becomes in GGUF, read backwards)
and ``llama-vocab.cpp`` (the ``smollm`` pre-tokenizer: digits one by one, then GPT-2's byte-level regex).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .models import ModelLoadError

CONTROL_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL in tokenizer.ggml.token_type
# pre-tokenizers converted here (tokenizer.ggml.pre)
KNOWN_PRE = ("smollm",)


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer fields of a GGUF file.

    Attributes:
        tokens: token texts by id; types: llama.cpp token types by id; merges: BPE merges ("a b").
        bos_id, eos_id: ids; chat_template: Jinja source or None; model, pre: tokenizer.ggml.model / .pre.
    """

    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    chat_template: str | None
    model: str
    pre: str


def read_gguf_vocab(gguf_path: Path) -> GGUFVocab:
    """The tokenizer fields of ``gguf_path`` (gguf's reader; the 49k-entry arrays take about a second).

    Raises:
        ModelLoadError: the file lacks a tokenizer field this conversion needs.
    """
    import gguf

    f = gguf.GGUFReader(str(gguf_path)).fields

    def get(key: str, default=None):
        if key in f:
            return f[key].contents()
        if default is None:
            raise ModelLoadError(f"{gguf_path}: GGUF metadata lacks {key} (needed to write tokenizer.json)")
        return default

    return GGUFVocab(get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type"), get("tokenizer.ggml.merges"),
                     int(get("tokenizer.ggml.bos_token_id")), int(get("tokenizer.ggml.eos_token_id")),
                     f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else None,
                     str(get("tokenizer.ggml.model")), str(get("tokenizer.ggml.pre", "default")))


def build_hf_tokenizer(vocab: GGUFVocab, where: str = "GGUF", extra_special: tuple[str, ...] = ()):
    """A ``tokenizers.Tokenizer`` equal to the GGUF one: control tokens are special added tokens, and
    ``extra_special`` are appended after the vocabulary (ids ``len(tokens)``, ``len(tokens) + 1``, ...).

    Args:
        vocab: from :func:`read_gguf_vocab`; where: the file, for messages.
    Returns:
        (tokenizers.Tokenizer, tokenizer_config dict: bos/eos token, add_bos_token false, chat template).
    Raises:
        ModelLoadError: a tokenizer model or pre-tokenizer this conversion does not know (see ``KNOWN_PRE``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab.model != "gpt2" or vocab.pre not in KNOWN_PRE:
        raise ModelLoadError(f"{where}: cannot write tokenizer.json for tokenizer {vocab.model!r} with "
                             f"pre-tokenizer {vocab.pre!r} (converted: gpt2 with {', '.join(KNOWN_PRE)}); "
                             "give the model as a HF directory instead")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(vocab.tokens, vocab.types)
                            if ty == CONTROL_TYPE])
    taken = set(vocab.tokens)
    new = [t for t in extra_special if t not in taken]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
    config = {"bos_token": vocab.tokens[vocab.bos_id], "eos_token": vocab.tokens[vocab.eos_id],
              "add_bos_token": False, "chat_template": vocab.chat_template}
    if new:
        config["additional_special_tokens"] = list(new)
    return tok, config


def write_hf_tokenizer(gguf_path: Path, out: Path, extra_special: tuple[str, ...] = (),
                       config: dict | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF file's vocabulary into ``out``.

    Args:
        extra_special: special tokens to append (see :func:`build_hf_tokenizer`).
        config: entries to set in tokenizer_config.json over the converted ones.
    Raises:
        ModelLoadError: see :func:`read_gguf_vocab` and :func:`build_hf_tokenizer`.
        OSError: ``out`` cannot be written.
    """
    tok, conf = build_hf_tokenizer(read_gguf_vocab(gguf_path), str(gguf_path), extra_special)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({**conf, **(config or {})}, indent=1))


def add_special_tokens_to_dir(src: Path, out: Path, extra_special: tuple[str, ...]) -> None:
    """Copy a HF directory's tokenizer files from ``src`` to ``out``, ``extra_special`` appended as special
    tokens (those already in the vocabulary are left as they are).

    Raises:
        ModelLoadError: ``src`` has no tokenizer.json. OSError: ``out`` cannot be written.
    """
    from tokenizers import AddedToken, Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise ModelLoadError(f"{src}: no tokenizer.json in this directory")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    new = [t for t in extra_special if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    conf_path = out / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    # transformers' tokenizer loader re-adds what the config lists; keep ours there too
    conf.pop("added_tokens_decoder", None)
    listed = list(conf.get("additional_special_tokens") or [])
    conf["additional_special_tokens"] = listed + [t for t in new if t not in listed]
    conf_path.write_text(json.dumps(conf, indent=1))
