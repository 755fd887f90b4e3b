"""`python -m trainer JOB.json`: train, convert for llama.cpp when asked, print events; exit 0 only with an adapter."""

from __future__ import annotations

import os
import sys
import traceback

from trainer.signals import Signals

SIGNALS = Signals()  # first: a stop or pause asked while torch loads is not lost

# Never reach a hub, and keep stderr for what matters: its last lines become the job's error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec  # noqa: E402 (after the environment above, which the libraries read at import)

from schemas.events import Failed, TrainerSpec  # noqa: E402
from trainer.errors import JobError  # noqa: E402
from trainer.events import emit  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m trainer JOB.json", file=sys.stderr)
        return 2
    try:
        with open(argv[1], "rb") as f:
            spec = msgspec.json.decode(f.read(), type=TrainerSpec)
        if spec.request.served_by == "llamacpp":
            from trainer.gguf_export import check_exportable

            check_exportable(spec.request.base_dir)  # before training, not after it
        if spec.request.train.method == "session":  # a training session: takes calls until stopped or idle
            from trainer.session.serve import serve

            emit(serve(spec, SIGNALS))
            return 0
        if spec.request.train.method == "eval":  # an eval run: samples and grades, trains nothing
            from trainer.evaluate import evaluate

            emit(evaluate(spec))
            return 0
        from trainer.job.loop import train  # torch loads here, after the spec is known to be sound

        finished = train(spec, SIGNALS)
        if spec.request.served_by == "llamacpp" and os.environ.get("RANK", "0") == "0":
            from trainer.gguf_export import export_adapter

            finished.gguf_path = str(
                export_adapter(
                    finished.adapter_dir,
                    spec.request.base_dir,
                    f"{spec.out_dir}/adapter.gguf",
                    spec.request.gguf_type,
                    name=f"{spec.request.model} LoRA {spec.job}",
                    base_model=spec.request.model,
                )
            )
        emit(finished)
        return 0
    except (JobError, msgspec.ValidationError) as e:
        emit(Failed(message=str(e)))
        return 1
    except Exception as e:
        traceback.print_exc()
        emit(Failed(message=f"the trainer failed: {e!r}"))
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
