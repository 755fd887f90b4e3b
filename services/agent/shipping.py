"""What a job's run sends to the object store and fetches from it: checkpoints as they come, the adapter, its
GGUF and its TensorBoard log at the end, and the checkpoint a resumed job goes on from."""

from __future__ import annotations

import asyncio
import tarfile
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas.artifacts import ArtifactKind, ArtifactMeta
from schemas.events import Checkpoint, Finished, Progress
from schemas.job_status import ArtifactRef, CheckpointInfo
from schemas.nodes import Assignment
from services import __version__
from services.transfer.download import download_named, safe_extract
from services.transfer.sender import upload_file


def tar_dir(src: Path, dest: Path) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                tar.add(p, arcname=str(p.relative_to(src)))


def summary(a: Assignment) -> str:
    lo, tr = a.request.lora, a.request.train
    return (
        f"r={lo.r} alpha={lo.alpha} dropout={lo.dropout} rslora={lo.rslora} lr={tr.learning_rate} "
        f"epochs={tr.epochs} max_steps={tr.max_steps} batch={tr.batch_size}x{tr.grad_accum} seq={tr.max_seq_length}"
    )


def _meta(a: Assignment, filename: str, **more) -> ArtifactMeta:
    return ArtifactMeta(
        base_model=a.request.model,
        trainer_version=__version__,
        tenant=a.tenant or "",
        filename=filename,
        attempt=a.attempt,
        **more,
    )


async def _upload(
    nc: Client, node: str, a: Assignment, kind: ArtifactKind, path: Path, meta: ArtifactMeta
) -> ArtifactRef:
    info = await upload_file(nc, node, a.job, kind, path, meta)
    return ArtifactRef(kind=kind, name=info.name, size=info.size, sha256=info.sha256)


async def ship_checkpoint(
    nc: Client, node: str, a: Assignment, ev: Checkpoint, last: Progress | None
) -> CheckpointInfo:
    """A checkpoint as tar.gz, stored as <job>/checkpoint-<step>, with the losses (grpo: the eval reward) last
    reported before it."""
    tar_path = Path(ev.path).parent / f"step-{ev.step}.tar.gz"
    await asyncio.to_thread(tar_dir, Path(ev.path), tar_path)
    ref = await _upload(
        nc,
        node,
        a,
        "checkpoint",
        tar_path,
        _meta(a, f"{a.job}-checkpoint-{ev.step}.tar.gz", summary=f"step {ev.step}", step=ev.step),
    )
    return CheckpointInfo(
        step=ev.step,
        name=ref.name,
        loss=last.loss if last else None,
        eval_loss=last.eval_loss if last else None,
        created=time.time(),
        eval_reward=last.eval_reward if last else None,
    )


async def ship_results(nc: Client, node: str, a: Assignment, result: Finished, out_dir: Path) -> list[ArtifactRef]:
    """The adapter as tar.gz, the GGUF when made and the TensorBoard log, uploaded before the job may succeed (an
    eval run's: its results, JSONL)."""
    if a.request.train.method == "eval":
        results = Path(result.adapter_dir) / "results.jsonl"
        return [await _upload(nc, node, a, "eval", results, _meta(a, f"{a.job}-eval.jsonl", summary="eval results"))]
    adapter = Path(result.adapter_dir)
    tar_path = adapter.parent / "adapter.tar.gz"
    await asyncio.to_thread(tar_dir, adapter, tar_path)
    meta = _meta(a, f"{a.job}-adapter.tar.gz", summary=summary(a))
    files = [("peft", tar_path, meta)]
    if result.gguf_path:
        files.append(
            (
                "gguf",
                Path(result.gguf_path),
                msgspec.structs.replace(meta, filename=f"{a.job}-lora-{a.request.gguf_type}.gguf"),
            )
        )
    board = out_dir / "tensorboard"
    if board.is_dir() and any(board.iterdir()):
        board_tar = out_dir / "tensorboard.tar.gz"
        await asyncio.to_thread(tar_dir, board, board_tar)
        files.append(("tensorboard", board_tar, msgspec.structs.replace(meta, filename=f"{a.job}-tensorboard.tar.gz")))
    refs = [await _upload(nc, node, a, kind, path, m) for kind, path, m in files]  # type: ignore[arg-type]
    return [msgspec.structs.replace(r, probe=result.probe) if r.kind == "peft" else r for r in refs]


async def fetch_adapter(nc: Client, peft: str, job_dir: Path) -> Path:
    """A registered adapter version's PEFT archive, unpacked into the job's directory."""
    return await _fetch_unpacked(nc, peft, job_dir / "init-adapter")


async def fetch_checkpoint(nc: Client, a: Assignment, job_dir: Path) -> Path:
    """The checkpoint named in the assignment, unpacked into the job's directory."""
    assert a.resume_from is not None, "only an assignment that resumes has a checkpoint to fetch"
    return await _fetch_unpacked(nc, a.resume_from, job_dir / "resume")


async def fetch_session_start(nc: Client, a: Assignment, job_dir: Path) -> Path | None:
    """The saved state a training session starts from (another session's checkpoint), unpacked; None for none."""
    start = a.request.session.start_from if a.request.session is not None else None
    if start is None or start.checkpoint is None or a.resume_from is not None:  # a resumed one has its own
        return None
    return await _fetch_unpacked(nc, start.checkpoint, job_dir / "start")


async def _fetch_unpacked(nc: Client, name: str, where: Path) -> Path:
    """A stored archive downloaded beside `where` and unpacked into it."""
    archive = where.with_name(f"{where.name}.tar.gz")
    where.parent.mkdir(parents=True, exist_ok=True)
    await download_named(nc, name, archive)
    return await asyncio.to_thread(safe_extract, archive, where)
