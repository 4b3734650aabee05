"""One prefix-cache entry on disk: a safetensors file whose metadata carries a checksum.

The checksum (sha256) covers the model identity, the token prefix, the position, and every tensor's
name, dtype, shape and bytes, so a truncated, damaged or foreign entry (another prompt's tensors under
this one's metadata) fails :func:`read_entry` instead of being restored. Writes are atomic (a
temporary file in the same directory, fsynced, then renamed over the entry); reads never follow a
symbolic link.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import struct
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..state import Snapshot

LOGITS_KEY = "last_logits"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
FORMAT = "ds4serve-prefix-1"


class BadEntry(Exception):
    """A disk entry that must not be used (unreadable, damaged, or not the one asked for)."""


def digest(model_id: str, tokens: list[int], pos: int, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the model identity, the token prefix, ``pos`` and every tensor (sorted by name)."""
    h = hashlib.sha256(FORMAT.encode())
    for part in (model_id, json.dumps(tokens), str(pos)):
        h.update(b"\0" + part.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_entry(directory: Path, stem: str, snap: Snapshot, model_id: str) -> Path:
    """Write ``snap`` atomically to ``directory/stem.safetensors``; raises OSError on failure."""
    tensors = {
        f"{layer}.{name}": t.contiguous().cpu()
        for layer, saved in snap.layers.items()
        for name, t in saved.items()
    }
    if snap.last_logits is not None:
        tensors[LOGITS_KEY] = snap.last_logits.contiguous().cpu()
    meta = {
        "format": FORMAT,
        "model_id": model_id,
        "pos": str(snap.pos),
        "tokens": json.dumps(snap.tokens),
        "layers": json.dumps(sorted(snap.layers)),
        "has_logits": "1" if snap.last_logits is not None else "0",
        "checksum": digest(model_id, snap.tokens, snap.pos, tensors),
    }
    data = save_tensors(tensors, metadata=meta)
    path = directory / f"{stem}{SUFFIX}"
    tmp = directory / f".{stem}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return path


def read_header(path: Path) -> dict[str, str]:
    """The metadata of an entry, read from its header only; raises :class:`BadEntry`."""
    try:
        with _open(path) as f:
            return _metadata(f, os.fstat(f.fileno()).st_size)
    except BadEntry:
        raise
    except Exception as exc:  # noqa: BLE001 - anything in a damaged file is a bad entry
        raise BadEntry(f"{type(exc).__name__}: {exc}") from None


def read_entry(path: Path, model_id: str, tokens: list[int]) -> Snapshot:
    """The snapshot stored at ``path``, verified to be ``tokens`` of ``model_id``; raises :class:`BadEntry`."""
    try:
        with _open(path) as f:
            data = f.read()
        meta = _metadata(io.BytesIO(data), len(data))
        pos = int(meta["pos"])
        stored_tokens = json.loads(meta["tokens"])
        layers: dict[int, dict[str, torch.Tensor]] = {int(i): {} for i in json.loads(meta["layers"])}
        expected = meta["checksum"]
        tensors = load_tensors(data)
    except BadEntry:
        raise
    except Exception as exc:  # noqa: BLE001 - anything in a damaged file is a bad entry
        raise BadEntry(f"{type(exc).__name__}: {exc}") from None
    if meta.get("model_id") != model_id or stored_tokens != tokens or pos != len(tokens):
        raise BadEntry("the entry belongs to another model or token prefix")
    if digest(model_id, tokens, pos, tensors) != expected:
        raise BadEntry("checksum mismatch")
    logits = tensors.pop(LOGITS_KEY, None)
    for key, t in tensors.items():
        layer, name = key.split(".", 1)
        layers.setdefault(int(layer), {})[name] = t
    return Snapshot(pos=pos, tokens=list(tokens), layers=layers, last_logits=logits)


def _metadata(f, size: int) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file open at its start, checked to be a ds4serve entry."""
    head = f.read(8)
    if len(head) < 8:
        raise BadEntry("shorter than a header")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise BadEntry("header longer than the file")
    meta = json.loads(f.read(n)).get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadEntry("no ds4serve prefix-cache metadata")
    return meta


def _open(path: Path):
    """``path`` opened for reading without following a symbolic link (OSError if it is one)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    return os.fdopen(fd, "rb")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
