"""A problem with the job that the submitter can fix; the message says how."""


class JobError(Exception):
    pass


def bitsandbytes_on_gpu(what: str, device: str, instead: str):
    """bitsandbytes for a setting that needs it on a GPU (`what`, e.g. "train.optimizer adamw_8bit"), or the
    JobError that says what to choose `instead`."""
    if device != "cuda":
        raise JobError(
            f"{what} needs bitsandbytes on a GPU, and this job runs on a CPU; submit it with accelerator "
            f"'gpu', or choose {instead}"
        )
    try:
        import bitsandbytes
    except ImportError:
        raise JobError(
            f"{what} needs bitsandbytes on the node: pip install 'jetlora[qlora]' there, or choose {instead}"
        ) from None
    return bitsandbytes
