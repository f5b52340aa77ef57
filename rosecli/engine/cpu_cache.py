"""A model's CPU weights, prepared once (`rosecli.engine.models.quant`) and cached.

Preparing ``--cpu-weights auto`` for SmolLM2-135M (checking every group of every layer for 4-bit
codes, packing them, rounding the output layer to float16) takes longer than the rest of start-up,
and the float32 weights it starts from are 540 MB to read. So the prepared state is saved under
``<cache>/cpu-weights/<key>/`` and later starts load it instead: the codes, scales and float16
layers as they are, plus the embedding and norms. The key covers everything the saved bytes depend
on: the source weight files (path, size, modification time), the representation and which layers
it leaves in float16, torch's version
and the CPU kernel family (torch packs 4-bit codes differently for AVX-512 and AVX2). A manifest of
sizes and checksums (`rosecli.engine.cache_files`) is checked before every use; a cache that fails it
is named in an error and never used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional

import torch

from rosecli.engine import cache_files
from rosecli.engine.errors import ModelLoadError
from rosecli.engine.models import quant

FORMAT = 1
WEIGHTS = "model.safetensors"
MANIFEST = "prepared.json"


def cache_key(weight_files: list[Path], kind: str) -> str:
    ident = {"format": FORMAT, "kind": kind, "policy": quant.FLOAT16_LAYERS, "torch": torch.__version__,
             "cpu": torch.backends.cpu.get_cpu_capability(),
             "files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in weight_files]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def load(directory: Path, model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """``model`` (built, weights not loaded) restored from ``directory``; None if nothing is cached there."""
    from safetensors.torch import load_file

    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None
    try:
        info = json.loads(manifest.read_text())
        wrong = cache_files.first_mismatch(directory, info["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        wrong = f"{MANIFEST} cannot be read ({type(e).__name__})"
    if wrong is None:
        try:
            return quant.restore(model, info["layout"], load_file(str(directory / WEIGHTS)))
        except Exception as e:  # the files check out but do not fit this model
            wrong = f"{WEIGHTS} does not fit the model ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    raise ModelLoadError(f"the prepared CPU weights in {directory} are corrupt: {wrong}. Delete that directory; "
                         "the next start prepares them again")


def save(directory: Path, model: torch.nn.Module) -> bool:
    """Write ``model``'s prepared state to ``directory`` (replaced atomically); False if the cache
    cannot be written (the run goes on without it)."""
    from safetensors.torch import save_file

    try:
        with cache_files.writing_dir(directory) as tmp:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS),
                      metadata={"format": "pt"})
            (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "layout": quant.layout(model),
                                                    "files": cache_files.manifest(tmp, [WEIGHTS])}))
        return True
    except OSError:
        return (directory / MANIFEST).is_file()  # another process may have written the same cache first


def prepared(directory: Path, model: torch.nn.Module, kind: str,
             load_weights: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """``model`` in representation ``kind``: from the cache at ``directory`` when there, else loaded
    with ``load_weights``, prepared, and cached."""
    cached = load(directory, model)
    if cached is not None:
        return cached
    load_weights(model)
    quant.prepare_cpu_weights(model, kind)
    save(directory, model)
    return model
