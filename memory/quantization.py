"""An ONNX encoder with int8 matrix products, derived once from the model file and cached.

`int8_model(source, cache_dir)` returns the path of a copy of the ONNX model `source` whose
matrix products run in int8 (ONNX Runtime's dynamic quantization: weights per output channel,
activations scaled per run), writing it under `cache_dir` the first time and reusing it after.
The local embedder (`memory.embeddings.LocalEmbedder`) runs it in place of `source`.

Why: the packaged MiniLM stores int8 weights but decodes them to float32 when loaded, so its
products ran in float32 (76% of its time). In int8 they take half the CPU time of a message or a
query (measured: 4.7-5.6 against 10.9-13.2 ms per LoCoMo message; docs/benchmarks.md, "The local
model in int8") for vectors at cosine similarity 0.99 (mean; at least 0.98) to the float32
products'.

A run's activations share one scale, so a text's vector would depend on the texts padded
beside it: the embedder runs each text alone when it uses this model.

* The copy is named by a digest of `source` and the ONNX Runtime version, written to a
  temporary file of its own and renamed into place, so processes (or threads) converting
  together never read half a file, and a changed model or runtime is converted again.
* When `cache_dir` cannot be written, the copy goes to a temporary directory for the process's
  lifetime (converted again at the next start: ~4 s) and a warning says so.
* Conversion failures raise `ProviderError`, as loading the model does.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

import platformdirs

from memory.errors import ProviderError

__all__ = ["FORMAT", "default_cache_dir", "int8_model"]

log = logging.getLogger(__name__)

FORMAT: Final = "dynamic-int8-v1"
"""What the converted copy is; part of its name, so a new conversion never reuses an old one."""


def default_cache_dir() -> Path:
    """`models` in the user's cache directory for memstrata (on Linux
    `$XDG_CACHE_HOME/memstrata/models`, else `~/.cache/memstrata/models`)."""
    return Path(platformdirs.user_cache_dir("memstrata", appauthor=False)) / "models"


def int8_model(source: Path, cache_dir: Path) -> Path:
    """The int8 copy of `source` (see the module docstring), converted on first use."""
    import onnxruntime

    try:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise ProviderError(f"cannot read the embedding model {source}: {exc}") from exc
    name = f"{source.stem}-{digest}-ort{onnxruntime.__version__}-{FORMAT}.onnx"
    cached = cache_dir / name
    if cached.is_file():
        return cached
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _convert(source, cached)
        return cached
    except OSError as exc:
        log.warning(
            "cannot write the int8 embedding model to %s (%s): converting it for this process only",
            cache_dir,
            exc,
        )
    scratch = Path(tempfile.mkdtemp(prefix="memstrata-model-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    _convert(source, scratch / name)
    return scratch / name


def _convert(source: Path, target: Path) -> None:
    """Write the int8 copy of `source` to `target` (atomically: a temporary file renamed)."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    log.info("converting the embedding model %s to int8 products (once)", source)
    # A name of its own: another process or thread may be converting the same model.
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    partial = Path(name)
    root = logging.getLogger()
    root.addFilter(_quiet)
    try:
        with tempfile.TemporaryDirectory(prefix="memstrata-model-") as scratch:
            folded = Path(scratch) / "folded.onnx"
            # The basic graph optimizations fold the stored weights' decoding (int8 to
            # float32) into plain float32 weights, which the quantizer then reads per channel.
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.optimized_model_filepath = str(folded)
            ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
            quantize_dynamic(folded, partial, weight_type=QuantType.QInt8, per_channel=True)
    except Exception as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise
        raise ProviderError(f"cannot convert the embedding model {source}: {exc}") from exc
    finally:
        root.removeFilter(_quiet)
    os.replace(partial, target)


def _quiet(record: logging.LogRecord) -> bool:
    """Drop the quantizer's advice to pre-process the model, logged on the root logger: its
    shape inference would change nothing here."""
    return "pre-processing before quantization" not in record.getMessage()
