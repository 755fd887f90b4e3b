"""The tinker-cookbook's own loops, unmodified, against a jetlora gateway: run by bench/cookbook_run.py with the
cookbook's venv's python (tinker 0.38.0, tinker-cookbook 0.6.1), never imported by jetlora.

    python bench/cookbook_loops.py --base-url URL --model DIR --out DIR [--only sl,resume,rl,sample,...]

Only the cookbook's public configs are set: the model is named by its local directory (the cookbook's
tokenizer_utils loads a directory's tokenizer itself, no hub), the renderer is `role_colon` (a tiny model is in no
model registry), the supervised data is the cookbook's example_data/conversations.jsonl and RL is math_rl's
arithmetic environment (neither downloads). Each loop is a row of the JSON report it prints last: ok, seconds, what
it saw, and the error it ended with."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import traceback
from pathlib import Path

RENDERER = "role_colon"


def sl_config(args, log_path: Path, max_steps: int):
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    import tinker_cookbook

    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model,
        renderer_name=RENDERER,
        max_length=128,
        batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    return train.Config(
        log_path=str(log_path),
        model_name=args.model,
        recipe_name="recipe_sl_basic",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=8),
        learning_rate=1e-3,
        lora_rank=8,
        base_url=args.base_url,
        save_every=2,
        eval_every=2,
        rolling_save_every=1,  # a rolling save each step, the one before deleted: the cookbook's clean-up
        max_steps=max_steps,
    )


def metrics_rows(log_path: Path) -> list[dict]:
    path = log_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoints(log_path: Path) -> list[dict]:
    path = log_path / "checkpoints.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def sl(args) -> dict:
    """sl_basic's loop (supervised.train.main): 4 steps, an NLL evaluator on a held-out set, saves, rolling saves."""
    from tinker_cookbook.supervised import train

    log_path = Path(args.out) / "sl"
    await train.main(sl_config(args, log_path, max_steps=4))
    rows, saved = metrics_rows(log_path), checkpoints(log_path)
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2, 3], f"metrics steps {steps}"
    assert any("test/nll" in r for r in rows), "no evaluator metrics (test/nll)"
    assert saved and saved[-1].get("sampler_path"), f"no final sampler save: {saved}"
    return {"steps": steps, "nll": [r.get("train_mean_nll") for r in rows], "checkpoints": len(saved),
            "test_nll": [r["test/nll"] for r in rows if "test/nll" in r]}  # fmt: skip


async def resume(args) -> dict:
    """sl_basic's loop interrupted (cancelled, as Ctrl-C ends it) once it has saved past step 2, then run again in
    the same log dir: it resumes from its last state with the optimizer's (create_training_client_from_state_with_
    optimizer) after checking the run's renderer name (get_training_run's user_metadata), and finishes."""
    from tinker_cookbook.supervised import train

    log_path = Path(args.out) / "sl_resume"
    config = sl_config(args, log_path, max_steps=6)
    run = asyncio.ensure_future(train.main(config))
    while not run.done() and not any(c.get("batch", 0) >= 3 for c in checkpoints(log_path)):
        await asyncio.sleep(0.2)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    cut = [r["step"] for r in metrics_rows(log_path)]
    last = checkpoints(log_path)[-1]
    assert last.get("name") != "final", f"the run finished before it was interrupted: {last}"
    await train.main(config)
    steps = [r["step"] for r in metrics_rows(log_path)]
    assert steps == list(range(6)), f"metrics steps after the resume {steps}"
    return {"interrupted_after": cut, "resumed_from": last["state_path"], "steps": steps}


async def rl(args, loss_fn: str, name: str) -> dict:
    """math_rl's CLI loop on its arithmetic environment (rl.train.main): sampling with the training client's
    sampler, rewards, the loss (stable_reinforce is math_rl's default; importance_sampling rl_basic's)."""
    from tinker_cookbook.recipes.math_rl.train import CLIConfig, cli_main

    log_path = Path(args.out) / name
    config = CLIConfig(
        model_name=args.model, renderer_name=RENDERER, env="arithmetic", lora_rank=8, group_size=4,
        groups_per_batch=4, learning_rate=1e-3, max_tokens=5, log_path=str(log_path), base_url=args.base_url,
        eval_every=0, save_every=2, behavior_if_log_dir_exists="delete", loss_fn=loss_fn, max_steps=3,
    )  # fmt: skip
    await cli_main(config)
    rows = [r for r in metrics_rows(log_path) if "optimizer_step:unique" in r]  # the last row: the final save's
    assert [r["step"] for r in rows] == [0, 1, 2], f"metrics steps {[r['step'] for r in rows]}"
    rewards = [r.get("env/all/reward/total") for r in rows]
    kl = [round(r["optim/kl_sample_train_v1"], 6) for r in rows if "optim/kl_sample_train_v1" in r]
    return {"steps": len(rows), "reward": rewards, "kl_sample_train": kl, "checkpoints": len(checkpoints(log_path))}


async def sample(args) -> dict:
    """After the SL run's client is gone: a new client samples its final sampler path through the cookbook's
    message completer, with the renderer the run's metadata names (as its chat and eval tools do)."""
    import tinker
    from tinker_cookbook import checkpoint_utils, renderers
    from tinker_cookbook.completers import TinkerMessageCompleter
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    final = checkpoints(Path(args.out) / "sl")[-1]
    path = final["sampler_path"]
    name = await checkpoint_utils.resolve_renderer_name_from_checkpoint_or_default_async(
        model_name=args.model, explicit_renderer_name=None, load_checkpoint_path=final["state_path"],
        base_url=args.base_url,
    )  # fmt: skip
    assert name == RENDERER, f"the run's renderer read back as {name!r}"
    service = tinker.ServiceClient(base_url=args.base_url)
    client = await service.create_sampling_client_async(model_path=path)
    completer = TinkerMessageCompleter(client, renderers.get_renderer(name, get_tokenizer(args.model)), max_tokens=8)
    reply = await completer([{"role": "user", "content": "What is the capital of France?"}])
    return {"path": path, "renderer": name, "reply": reply["content"]}


async def download(args) -> dict:
    """weights.download of the SL run's final state (tinker://.../weights/...): the cookbook exports it through
    save_weights_external with an age recipient, fetches the signed URLs and decrypts."""
    from tinker_cookbook import weights

    final = checkpoints(Path(args.out) / "sl")[-1]
    out = Path(args.out) / "download"
    await asyncio.to_thread(weights.download, tinker_path=final["state_path"], output_dir=str(out),
                            base_url=args.base_url)  # fmt: skip
    files = sorted(p.name for p in out.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files, files
    return {"files": files}


LOOPS = {
    "sl": sl,
    "resume": resume,
    "rl": lambda a: rl(a, "stable_reinforce", "rl"),
    "rl_is": lambda a: rl(a, "importance_sampling", "rl_is"),
    "sample": sample,
    "download": download,
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True, help="the base model's directory: its name on the gateway too")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=",".join(LOOPS))
    args = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    report = []
    for name in args.only.split(","):
        start = time.monotonic()
        try:
            seen = asyncio.run(LOOPS[name](args))
            report.append({"loop": name, "ok": True, "s": round(time.monotonic() - start, 1), "seen": seen})
        except BaseException as e:  # noqa: BLE001 - each loop's failure is a row of the report
            traceback.print_exc()
            report.append({"loop": name, "ok": False, "s": round(time.monotonic() - start, 1),
                           "error": f"{type(e).__name__}: {e}"[:2000]})  # fmt: skip
        print(f"cookbook loop {name}: {json.dumps(report[-1])}", flush=True)
    print("REPORT " + json.dumps(report), flush=True)
    return 0 if all(r["ok"] for r in report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
