"""Checkpoints of an LM: `config.json` (the LMConfig; zoo models by name, custom Recipes field by
field) and `model.safetensors` (every weight, in its dtype; `load_pretrained` also reads a sharded
checkpoint, `model.safetensors.index.json` and the shards it names). The same directory is a transformers
checkpoint (`"model_type": "fastweights"`, `fastweights.hf`); keys transformers adds when it
saves (`transformers_version`, `dtype`, …) are ignored here. Files are written to a temporary
name and renamed, so a crash never leaves a half-written checkpoint under the real names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..inputs import InputError
from .config import ConfigError, LMConfig

__all__ = ["CheckpointError", "save_pretrained", "load_pretrained", "CONFIG_NAME", "WEIGHTS_NAME", "INDEX_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # a sharded checkpoint: the index and its shards instead
FORMAT = "fastweights.LM"
VERSION = 1
#: the value of a checkpoint's "routing" key when its "backends" are the layers' *requested* backends
#: ("auto" or a name). Checkpoints without it were written before calls were routed per call and recorded
#: the backends resolved on the machine that built the model ("torch" for every model built on a CPU).
ROUTING = "per-call"


#: transformers' remote-code entry: `auto_map` in config.json names classes of AUTO_MODULE, a file written next
#: to it that imports them from the installed package, so `AutoModelForCausalLM.from_pretrained(dir,
#: trust_remote_code=True)` loads the directory without `import fastweights.hf` first (transformers imports
#: only files inside the checkpoint directory: the file is the bridge; the code it runs is fastweights').
AUTO_MODULE = "fastweights_auto"
AUTO_MAP = {"AutoConfig": f"{AUTO_MODULE}.FastWeightsConfig", "AutoModel": f"{AUTO_MODULE}.FastWeightsModel",
            "AutoModelForCausalLM": f"{AUTO_MODULE}.FastWeightsForCausalLM"}
AUTO_SOURCE = '''"""transformers' remote-code entry of a fastweights checkpoint (config.json's auto_map names it):
the classes come from the installed fastweights package (pip install "fastweights[hf]"); importing it
registers them with transformers' Auto classes. Nothing else is defined or run here."""

from fastweights.hf import FastWeightsConfig, FastWeightsForCausalLM, FastWeightsModel  # noqa: F401
'''


def write_auto_module(directory) -> None:
    """Write AUTO_MODULE.py into a checkpoint directory (what config.json's auto_map names)."""
    path = Path(directory) / f"{AUTO_MODULE}.py"
    _atomic_write(path, lambda p: p.write_text(AUTO_SOURCE, encoding="utf-8"))


class CheckpointError(OSError):
    """A checkpoint that is missing, corrupt, or does not fit its config; the message names the file."""


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def requested_backends(backends, routing, config: LMConfig):
    """The backend each layer requests, from a checkpoint's "backends" and "routing" keys: the recorded
    list when routing is ROUTING; otherwise (a checkpoint written before calls were routed per call, whose
    "backends" are what "auto" resolved to where it was built, e.g. "torch" on a CPU) the config's own
    request, `config.layer_backend(i)` ("auto" unless the model was built with an explicit backend), so an
    old CPU-built checkpoint runs the Triton rows on a GPU. Its recorded names are not silently trusted."""
    if routing == ROUTING and backends is not None:
        return backends
    return [config.layer_backend(i) for i in range(config.n_layers)]


def save_pretrained(model, directory) -> None:
    from safetensors.torch import save_file

    if isinstance(directory, str) and not directory:
        raise CheckpointError("save_pretrained: the directory is empty (''); expected a directory to write "
                              "(give '.' for the current one)")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"save_pretrained: {d} is a file; expected a directory to write the checkpoint into")
    d.mkdir(parents=True, exist_ok=True)
    # model_type / architectures: the same directory loads with transformers' Auto classes (fastweights.hf)
    doc = {"format": FORMAT, "version": VERSION, "config": model.config.to_dict(), "backends": list(model.backends),
           "routing": ROUTING, "model_type": "fastweights", "architectures": ["FastWeightsForCausalLM"],
           "auto_map": AUTO_MAP}
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    _atomic_write(d / CONFIG_NAME, lambda p: p.write_text(text, encoding="utf-8"))
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic_write(d / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write_auto_module(d)


def _shards(index_path: Path) -> list[Path]:
    """The shard files an index names (`{"weight_map": {tensor name: file name}}`, as transformers'
    `save_pretrained(max_shard_size=...)` writes it), each once, in order; every one must exist."""
    try:
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index_path}: corrupt JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index_path}: expected a 'weight_map' of tensor name -> shard file name")
    files = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    for f in files:
        if f.parent != index_path.parent or not f.is_file():
            raise CheckpointError(f"{f}: missing (a shard that {index_path.name} names)")
    return files


def _check_backend_name(backend) -> None:
    """None, "auto" or the name of a backend this installation has (whether it serves each layer is
    the layer's check); InputError naming `backend` otherwise, before any file is read."""
    from ..dispatch import DISPATCH

    known = sorted({b for (_, _, b) in DISPATCH})
    if backend is not None and (not isinstance(backend, str) or backend not in ("auto", *known)):
        raise InputError(f"backend must be None, 'auto' or one of {known}, got {backend!r}")


def load_pretrained(cls, directory, *, device=None, backend: str | None = None):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..inputs import check_device

    device = check_device("device", device)  # (InputError naming it: not a device, or one this machine lacks)
    _check_backend_name(backend)
    if isinstance(directory, str) and not directory.strip():  # (Path("") is the current directory)
        raise CheckpointError("the checkpoint directory is empty (''); expected a directory save_pretrained wrote")
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: no such checkpoint directory (save_pretrained writes {CONFIG_NAME} and "
                              f"{WEIGHTS_NAME} there)")
    cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not w_path.is_file() and (d / INDEX_NAME).is_file():  # sharded (transformers' max_shard_size)
        w_path = d / INDEX_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (a checkpoint holds {CONFIG_NAME} and {WEIGHTS_NAME}, or "
                                  f"{INDEX_NAME} and its shards)")
    try:
        doc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: corrupt JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "config" not in doc:
        raise CheckpointError(f"{cfg_path}: not a fastweights LM config (expected format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{cfg_path}: checkpoint version {doc.get('version')!r}, this library reads {VERSION}")
    try:
        config = LMConfig.from_dict(doc["config"])
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    tensors = {}
    for shard in (_shards(w_path) if w_path.name == INDEX_NAME else [w_path]):
        try:
            tensors.update(load_file(str(shard)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{shard}: corrupt or truncated safetensors file ({e})") from None
    backends = requested_backends(doc.get("backends"), doc.get("routing"), config)
    if backend is not None:
        backends = [backend] * config.n_layers
    if not (isinstance(backends, list) and all(isinstance(b, str) for b in backends)):
        raise CheckpointError(f"{cfg_path}: 'backends' must be a list of backend names, got {backends!r}")
    if len(backends) != config.n_layers:
        lo, hi = sorted((len(backends), config.n_layers))
        raise CheckpointError(f"{cfg_path}: 'backends' names {len(backends)} layers but the config builds "
                              f"{config.n_layers}: backends missing or extra for layers {lo}…{hi - 1}")
    try:
        model = cls(config, backends=tuple(backends))
    except ValueError as e:  # a recorded backend this installation does not know, or the one asked for
        if backend is not None:
            raise InputError(f"backend={backend!r}: {e}") from None
        raise CheckpointError(f"{cfg_path}: {e}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{w_path}: does not match {cfg_path}: missing {missing[:8]}"
                              f"{'…' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                              f"{'…' if len(unexpected) > 8 else ''}")
    bad = [k for k in expected if tuple(expected[k].shape) != tuple(tensors[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(f"{w_path}: {k} has shape {list(tensors[k].shape)}, the config builds "
                              f"{list(expected[k].shape)} ({len(bad)} mismatched)")
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    with torch.no_grad():
        model.load_state_dict(tensors, strict=True)
    return model.to(device) if device is not None else model
