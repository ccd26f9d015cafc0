"""The model being fine-tuned as a ``transformers`` model, built from the weights zoomr itself loads.

zoomr's loader (:mod:`zoomr.backends.torch.weights`) already reads GGUF files (dequantized to float32, Q/K
rows in HF order) and HF safetensors directories under HF tensor names, every tensor checked; so the
transformers model is made from its configuration (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``) and those
tensors, offline, with no second GGUF reader. The tokenizer is written as HF files with the summary
delimiters appended as special tokens (:mod:`zoomr.backends.hf_tokenizer`) and, for a GGUF, checked to give
llama.cpp's ids.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zoomr.backends.hf_tokenizer import add_special_tokens_to_dir, read_gguf_vocab, write_hf_tokenizer
from zoomr.backends.models import ModelLoadError, ModelSource, resolve_model
from zoomr.backends.tokenizer import HFTokenizer
from zoomr.backends.torch.config import ModelConfig
from zoomr.errors import UserError
from zoomr.kvstore.segments import BEGIN, END

DELIMITERS = (BEGIN, END)
# Starting point of each new delimiter row: the mean of the rows of a short text that means what the token
# means (in the embedding, and in an untied head its own head rows), so that from step 0 the LM head scores
# the delimiter like that text's tokens at the places the text would go, instead of the vocabulary mean,
# which no context predicts. Begin opens a
# summary after a paragraph: "\n\nSummary:" (a paragraph break, then the usual label of a summary). End
# closes it and hands back to the reasoning, which goes on with a new paragraph: "\n\n".
DELIMITER_INIT_TEXTS = {BEGIN: "\n\nSummary:", END: "\n\n"}
# texts the converted tokenizer must split exactly as llama.cpp does (digits, spaces, newlines, unicode)
_CHECK_TEXTS = ("Natalia sold 48/2 = 24 clips in May.\n\nThe answer is \\boxed{72}.",
                "  x^2+3x-10=0 → (x+5)(x−2)=0;\tπ≈3.14159 «ok» 日本 🙂")


def load_weights(model: str | None) -> tuple[ModelSource, ModelConfig, dict]:
    """``-m MODEL`` resolved and read: (source, configuration, float32 numpy tensors under HF names).

    Raises:
        UserError: the model is missing, corrupt or of an architecture zoomr's torch backend cannot run, or a
            GGUF carries RoPE frequency divisors (``rope_freqs``: Llama 3.1+), which the exported HF directory
            cannot express.
    """
    from zoomr.backends.torch.weights import load_gguf, load_hf_dir, rope_freqs_trivial

    try:
        src = resolve_model(model)
        cfg, tensors, _ = load_gguf(src.path) if src.kind == "gguf" else load_hf_dir(src.path)
    except ValueError as e:
        raise UserError(f"-m {model or 'default'}: {e}") from None
    if not rope_freqs_trivial(tensors):
        raise UserError(f"-m {model}: this GGUF scales RoPE by per-frequency divisors (rope_freqs, Llama 3.1+), "
                        "which a fine-tuned HF directory cannot carry; fine-tune the model's HF directory instead")
    return src, cfg, tensors


def write_tokenizer(src: ModelSource, out: Path) -> HFTokenizer:
    """HF tokenizer files for ``src`` in ``out``, with :data:`DELIMITERS` as special tokens.

    Returns:
        the tokenizer read back by zoomr's :class:`HFTokenizer` (what ``zoomr solve -m DIR`` will use).
    Raises:
        UserError: the vocabulary cannot be converted, or the conversion tokenizes differently from llama.cpp.
    """
    try:
        if src.kind == "gguf":
            write_hf_tokenizer(src.path, out, DELIMITERS)
        else:
            add_special_tokens_to_dir(src.path, out, DELIMITERS)
        tok = HFTokenizer(out)
    except (ModelLoadError, ValueError) as e:
        raise UserError(str(e)) from None
    if src.kind == "gguf":
        from zoomr.backends.tokenizer import LlamaCppTokenizer

        ref = LlamaCppTokenizer(src.path)
        for text in _CHECK_TEXTS:
            if tok.encode(text, special=False) != ref.encode(text, special=False):
                raise UserError(f"{src.path}: the converted tokenizer.json splits {text[:30]!r} differently from "
                                "llama.cpp; give the model as a HF directory instead")
    missing = [d for d in DELIMITERS if d not in tok.control_tokens]
    if missing:
        raise UserError(f"{src.name}: tokenizer could not take {missing[0]} as a special token")
    return tok


def delimiter_ids(tok: HFTokenizer) -> list[int]:
    """Token ids of :data:`DELIMITERS` (begin, end) in ``tok``."""
    return [tok.control_tokens[d].id for d in DELIMITERS]


def existing_delimiters(src: ModelSource) -> dict[str, int]:
    """{delimiter: id} of the :data:`DELIMITERS` that the tokenizer of ``src`` already has (a model fine-tuned
    by zoomr before); {} for a model that has none, or a HF directory without ``tokenizer.json`` (refused
    later by :func:`write_tokenizer`).

    zoomr gives the delimiters the two ids after all other tokens, begin then end (:func:`write_tokenizer`
    appends them). One already there must sit at that id: then it is reused, id and trained rows alike
    (:func:`delimiter_init` leaves its rows as the model has them). At another id, the model's rows for it
    mean something zoomr did not train, and the exported tokenizer would disagree with how zoomr numbers
    them, so it is refused.

    Raises:
        UserError: a delimiter at another id (one line, naming both ids), or a tokenizer that cannot be read.
    """
    try:
        if src.kind == "gguf":
            tokens = read_gguf_vocab(src.path).tokens
            size, found = len(tokens), {t: i for i, t in enumerate(tokens) if t in DELIMITERS}
        else:
            from tokenizers import Tokenizer

            if not (src.path / "tokenizer.json").is_file():
                return {}
            hf = Tokenizer.from_file(str(src.path / "tokenizer.json"))
            size = hf.get_vocab_size(with_added_tokens=True)
            found = {d: hf.token_to_id(d) for d in DELIMITERS if hf.token_to_id(d) is not None}
    except ModelLoadError as e:
        raise UserError(str(e)) from None
    except Exception as e:  # tokenizers raises a plain Exception for a malformed tokenizer.json
        raise UserError(f"{src.path}: cannot read tokenizer.json ({e})") from None
    others = size - len(found)
    for k, d in enumerate(DELIMITERS):
        if d in found and found[d] != others + k:
            raise UserError(f"-m {src.name}: its tokenizer already has {d} as id {found[d]}, but zoomr gives it id "
                            f"{others + k} (after the other {others} tokens, begin then end); give the model "
                            "without these tokens")
    return found


def delimiter_init(tok: HFTokenizer, existing: dict[str, int] | None = None) -> dict[int, list[int]]:
    """{delimiter id: ids of the existing tokens whose mean embedding row it starts from}
    (:data:`DELIMITER_INIT_TEXTS` tokenized as plain text); the delimiters in ``existing`` (see
    :func:`existing_delimiters`) are left out: their rows are the model's own."""
    return {tok.control_tokens[d].id: tok.encode(text, special=False) for d, text in DELIMITER_INIT_TEXTS.items()
            if d not in (existing or {})}


def transformers_model(cfg: ModelConfig, tensors: dict, vocab: int, init_rows: dict[int, list[int]] | None = None):
    """A transformers causal LM holding ``tensors``, its embedding (and untied LM head) resized to ``vocab``
    rows; the new rows start at the mean of the old ones (transformers' ``mean_resizing``), except the rows
    in ``init_rows``, which start at the mean of the rows of the ids listed for them.

    Args:
        cfg: zoomr's configuration; tensors: float32 numpy arrays under HF names; vocab: rows after resizing;
        init_rows: {new row id: existing token ids [n >= 1]} (see :func:`delimiter_init`).
    Returns:
        the model, float32, in train mode.
    Raises:
        UserError: transformers (the ``finetune`` extra) is missing, or cannot build or fill this architecture.
    """
    import numpy as np
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError("zoomr finetune needs the finetune extra: pip install 'zoomr[finetune]'") from None
    hf = cfg.to_hf()
    model_type = hf.pop("model_type")
    arch = hf.pop("architectures")
    try:
        tcfg = AutoConfig.for_model(model_type, **{k: v for k, v in hf.items() if v is not None})
        tcfg.architectures = arch
        model = AutoModelForCausalLM.from_config(tcfg, torch_dtype=torch.float32)
    except Exception as e:  # transformers raises ValueError/KeyError/ImportError for what it cannot build
        raise UserError(f"transformers cannot build a trainable {model_type} model ({type(e).__name__}: {e})") from None
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items() if k != "rope_freqs"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tied_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"transformers' {arch[0]} does not match zoomr's weights (missing: {missing[:2]}, "
                        f"unexpected: {unexpected[:2]})")
    if cfg.tied_embeddings:
        model.tie_weights()
    model.resize_token_embeddings(vocab, mean_resizing=True)
    with torch.no_grad():
        for row, ids in (init_rows or {}).items():
            for w in {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
                      if m is not None}.values():  # one matrix when tied
                w[row] = w[torch.tensor(ids)].mean(0)
    return model


def merged_tensors(model, cfg: ModelConfig) -> tuple[ModelConfig, dict]:
    """(configuration with the new vocabulary size, float32 numpy tensors) of a merged transformers model,
    as :func:`zoomr.backends.torch.weights.write_hf_dir` writes them (no tied LM head copy)."""
    sd = model.state_dict()
    rows = sd["model.embed_tokens.weight"].shape[0]
    tensors = {k: v.detach().float().cpu().numpy() for k, v in sd.items()
               if not (cfg.tied_embeddings and k == "lm_head.weight")}
    return replace(cfg, vocab=rows), tensors
