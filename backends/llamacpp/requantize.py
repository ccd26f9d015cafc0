"""GGUF files re-quantized by llama.cpp's own quantizer, e.g. the K-quant files most published models ship as.

The torch backend's K-quant path is tested and benchmarked on files llama.cpp itself wrote
(``llama_model_quantize``, what ``llama-quantize`` runs), so their layout and type mix are the real ones: a
Q4_K_M file mixes Q4_K with Q6_K and, where a tensor's row is not a whole number of 256-weight super-blocks,
llama.cpp's fallbacks (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0; ``llama_tensor_get_type`` in llama-quant.cpp).
"""

from __future__ import annotations

from pathlib import Path


def requantize(src: Path, dst: Path, ftype: str, threads: int = 1) -> Path:
    """Write ``src`` re-quantized to llama.cpp file type ``ftype`` as ``dst`` (quantized sources allowed).

    Args:
        src: a GGUF file; dst: where to write (overwritten).
        ftype: a llama.cpp file type as its ``LLAMA_FTYPE_MOSTLY_`` suffix: ``Q4_K_M``, ``Q5_K_M``, ``Q6_K``,
            ``Q8_0`` ...
        threads: quantizer threads.
    Returns:
        ``dst``.
    Raises:
        ValueError: an ``ftype`` this llama-cpp-python does not name.
        RuntimeError: llama.cpp's quantizer failed (its return code).
    """
    import llama_cpp

    from zoomr.backends.llama_log import silence_llama_logs

    silence_llama_logs()   # llama.cpp logs every tensor it writes (ZOOMR_DEBUG=1 keeps them)
    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise ValueError(f"llama.cpp has no file type {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True   # the source may itself be quantized (the embedded model is Q4_1)
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (return code {rc})")
    return dst


def requantize_to_temp(src: Path, ftype: str) -> tuple[Path, "tempfile.TemporaryDirectory"]:
    """:func:`requantize` into a new temporary directory (the benchmarks' ``--requantize``).

    Returns:
        (the file, its directory: the file lasts while the directory object is referenced).
    Raises:
        ValueError, RuntimeError: as :func:`requantize`.
    """
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="zoomr-requantize-")
    return requantize(src, Path(tmp.name) / f"{Path(src).stem}-{ftype}.gguf", ftype), tmp
