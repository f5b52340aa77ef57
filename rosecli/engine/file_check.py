"""Checksums of cached files: a cache that was cut short or changed on disk is named, never used.

Caches write a manifest of ``{file name: {"size", "crc32"}}`` when they are made and check it before
every use. CRC-32 (zlib) reads about 2 GB/s, so checking a 540 MB float32 cache costs a quarter of
a second; a cryptographic hash would cost several times that and guard against nothing more here
(the cache is ours, not an attacker's).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Optional

CHUNK = 16 << 20


def follow_umask(root: Path) -> None:
    """mkdtemp and safetensors create private (0700/0600) entries; a cache follows the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for f in Path(root).iterdir():
        os.chmod(f, 0o666 & ~mask)


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def manifest(directory: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of each named file of ``directory``."""
    out = {}
    for name in names:
        path = Path(directory) / name
        out[name] = {"size": path.stat().st_size, "crc32": crc32(path)}
    return out


def first_mismatch(directory: Path, expected: dict) -> Optional[str]:
    """None if every file of ``expected`` (a `manifest`) is there unchanged, else what is wrong."""
    for name, want in expected.items():
        path = Path(directory) / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want.get("size"):
            return f"{name} has {size} bytes, {want.get('size')} were written"
        if crc32(path) != want.get("crc32"):
            return f"{name} has changed since it was written (checksum mismatch)"
    return None
