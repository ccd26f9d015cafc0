"""Model tokenizers: llama.cpp's own vocabulary for GGUF files, HF ``tokenizers`` for HF directories.

Both implement :class:`zoomr.backends.base.Tokenizer`. For GGUF the vocabulary is loaded vocab-only by
llama.cpp, which is the exact tokenizer llama.cpp itself runs (pre-tokenizer regexes included). Both honour
``special`` (control tokens parsed or not) and add BOS/EOS only where the tokenizer's configuration says so,
so a GGUF and the HF directory it was converted from give the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import ControlToken


def valid_text(text: str) -> str:
    """``text`` with lone surrogates (from ``surrogateescape`` decoding, e.g. a non-UTF-8 ``sys.argv``)
    replaced by U+FFFD: neither tokenizer can encode them. Paired surrogates become the character."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


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
        self.adds_bos = self.bos_id is not None and bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        eos, control = set(), {}
        # llama.cpp parses CONTROL and UNKNOWN tokens only with parse_special (USER_DEFINED ones always)
        only_special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        for i in range(self.vocab_size):
            if llama_cpp.llama_vocab_is_eog(vocab, i):
                eos.add(i)
            attr = llama_cpp.llama_vocab_get_attr(vocab, i)
            if attr & only_special:
                text = (llama_cpp.llama_vocab_get_text(vocab, i) or b"").decode("utf-8", "replace")
                if text:
                    control.setdefault(text, ControlToken(i, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                                          bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
        if llama.token_eos() >= 0:
            eos.add(int(llama.token_eos()))
        self.eos_ids = frozenset(eos)
        self.control_tokens = control
        self.chat_template = llama.metadata.get("tokenizer.chat_template")
        self.bos_text = self.decode([self.bos_id]) if self.bos_id is not None else ""
        self.eos_text = self.decode([int(llama.token_eos())]) if llama.token_eos() >= 0 else ""

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text`` (see :class:`zoomr.backends.base.Tokenizer`)."""
        return list(self._llama.tokenize(valid_text(text).encode("utf-8"), add_bos=add_bos, special=special))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens rendered as their text."""
        return self._llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace")


class HFTokenizer:
    """Tokenizer of a HF directory: ``tokenizer.json`` (+ ``tokenizer_config.json``,
    ``generation_config.json`` for BOS/EOS and the chat template).

    BOS/EOS around a sequence follow the configuration as transformers and llama.cpp's converter read it:
    ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` when set, else what
    ``tokenizer.json``'s post-processor adds. Added tokens marked ``special`` are the control tokens.

    Raises:
        ValueError: no tokenizer.json in ``path``.
    """

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json in this directory")
        self._tok = Tokenizer.from_file(str(tj))
        # a second instance that tokenizes special tokens' text as plain text (special=False)
        self._plain = Tokenizer.from_file(str(tj))
        self._plain.encode_special_tokens = True
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
        eos_id = self._tok.token_to_id(self.eos_text) if self.eos_text else None
        self.control_tokens = {t.content: ControlToken(i, bool(t.lstrip), bool(t.rstrip))
                               for i, t in sorted(self._tok.get_added_tokens_decoder().items())
                               if t.special and t.content}
        front, back = self._post_processor_adds()
        self.adds_bos = self.bos_id is not None and bool(conf.get("add_bos_token", front == self.bos_id))
        self._eos_added = eos_id if eos_id is not None and conf.get("add_eos_token", back == eos_id) else None
        eos = {eos_id} if eos_id is not None else set()
        gen_eos = gen.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids = frozenset(int(x) for x in eos)

    def _post_processor_adds(self) -> tuple[int | None, int | None]:
        """(id the post-processor puts first, id it puts last), None where it adds nothing there."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        if full == bare or len(full) <= len(bare):
            return None, None
        at = next((k for k in range(len(full) - len(bare) + 1) if full[k:k + len(bare)] == bare), 0)
        return (full[0] if at > 0 else None), (full[-1] if at + len(bare) < len(full) else None)

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text`` (see :class:`zoomr.backends.base.Tokenizer`)."""
        tok = self._tok if special else self._plain
        ids = tok.encode(valid_text(text), add_special_tokens=False).ids
        if add_bos and self.adds_bos:
            ids = [self.bos_id] + ids
        if add_bos and self._eos_added is not None:
            ids = ids + [self._eos_added]
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
