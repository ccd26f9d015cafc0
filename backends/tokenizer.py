"""Model tokenizers: llama.cpp's own vocabulary for GGUF files, HF ``tokenizers`` for HF directories.

Both implement :class:`zoomr.backends.base.Tokenizer`. For GGUF the vocabulary is loaded vocab-only by
llama.cpp, which is the exact tokenizer llama.cpp itself runs (pre-tokenizer regexes included).
"""

from __future__ import annotations

import json
from pathlib import Path


class LlamaCppTokenizer:
    """Tokenizer of a GGUF file, through llama-cpp-python with ``vocab_only=True`` (no weights loaded).

    Args:
        path: GGUF file.
        llama: an already-loaded ``llama_cpp.Llama`` over the same file, to share instead of loading.
    Raises:
        ValueError: llama.cpp cannot read the vocabulary.
    """

    def __init__(self, path: Path, llama=None):
        import llama_cpp

        from .llama_log import silence_llama_logs

        silence_llama_logs()
        if llama is None:
            try:
                llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            except Exception as e:
                raise ValueError(f"{path}: llama.cpp cannot read the vocabulary ({e})") from None
        self._llama = llama
        self.vocab_size = int(llama.n_vocab())
        bos = int(llama.token_bos())
        self.bos_id = bos if bos >= 0 else None
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        eos = {i for i in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        if llama.token_eos() >= 0:
            eos.add(int(llama.token_eos()))
        self.eos_ids = frozenset(eos)
        self.chat_template = llama.metadata.get("tokenizer.chat_template")
        self.bos_text = self.decode([self.bos_id]) if self.bos_id is not None else ""
        self.eos_text = self.decode([int(llama.token_eos())]) if llama.token_eos() >= 0 else ""

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text`` (see :class:`zoomr.backends.base.Tokenizer`)."""
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens rendered as their text."""
        return self._llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace")


class HFTokenizer:
    """Tokenizer of a HF directory: ``tokenizer.json`` (+ ``tokenizer_config.json``,
    ``generation_config.json`` for BOS/EOS and the chat template).

    Raises:
        ValueError: no tokenizer.json in ``path``.
    """

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json in this directory")
        self._tok = Tokenizer.from_file(str(tj))
        conf = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = conf.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_text = _token_text(conf.get("bos_token")) or ""
        self.eos_text = _token_text(conf.get("eos_token")) or ""
        self.bos_id = self._tok.token_to_id(self.bos_text) if self.bos_text else None
        self._add_bos = bool(conf.get("add_bos_token", False))
        eos = set()
        if self.eos_text and self._tok.token_to_id(self.eos_text) is not None:
            eos.add(self._tok.token_to_id(self.eos_text))
        gen_eos = gen.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids = frozenset(int(x) for x in eos)

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text``; added (special) tokens are always parsed by ``tokenizers``."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
