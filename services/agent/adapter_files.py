"""An adapter version's file from the object store onto the node's disk: checked against the registry's sha256, and
put in place whole (written beside, renamed in), so a crash or a full disk half way leaves nothing that looks
fetched. Blocking work (unpacking, renames) runs in threads."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from schemas import names
from schemas.registry import StoredFile
from services.transfer.download import fetch_object, fetch_small, safe_extract


async def download(js, file: StoredFile, gguf: bool, target: Path) -> None:
    """The PEFT directory (unpacked) or the GGUF file at `target`; raises RuntimeError saying why it was refused."""
    if not gguf:  # an adapter directory small enough to unpack from memory, in one thread hop
        try:
            data = await fetch_small(js, names.ARTIFACTS_BUCKET, file.name, file.sha256)
        except Exception as e:
            raise RuntimeError(f"refused {file.name}: {e}") from None
        if data is not None:
            await asyncio.to_thread(unpack, data, target)
            return
    part = target.parent / ("adapter.gguf.part" if gguf else "peft.tar.gz")
    try:
        await fetch_object(js, names.ARTIFACTS_BUCKET, file.name, part, file.sha256)  # corrupted: refused
    except Exception as e:
        raise RuntimeError(f"refused {file.name}: {e}") from None
    if gguf:
        await asyncio.to_thread(part.replace, target)
        return
    await asyncio.to_thread(unpack, part, target)
    await asyncio.to_thread(part.unlink)


def unpack(archive: Path | bytes, target: Path) -> None:
    """Extract beside the target and rename it into place whole."""
    partial = target.with_name(f"{target.name}.partial")
    shutil.rmtree(partial, True)  # what an earlier crash left
    safe_extract(archive, partial)
    partial.replace(target)
