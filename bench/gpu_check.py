"""Everything in jetlora that only a GPU shows, in one run of under 8 minutes on one card, printed as a report:

1. the agent's NVML figures against `nvidia-smi` (free and total memory of each card);
2. a bf16 job on a locally built model shaped like a 0.5B Llama (Qwen2-0.5B's widths), packed rows and padded
   batches, tokens/s and MFU against the card's peak, beside transformers.Trainer + peft on the same data;
3. the same job with `quantization: nf4` (bitsandbytes), if it installs;
4. bench/memory_estimate.py --cuda: the memory estimate against torch.cuda.max_memory_allocated;
5. with --vllm, vLLM's CUDA build loading the trained adapter, if it installs within the time left.

Run it where a GPU is lent (the `device` tool), from the repository root:

    bash deploy/setup.sh && .venv/bin/pip install -q -e .[qlora] && .venv/bin/python bench/gpu_check.py

`--dry-run` does every step it can on this machine's CPU with a small model, to check the script itself.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy" / "demo"))

from bench.train_throughput import make_pairs  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125, "RTX 4090": 165}
HALF_B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=16000)  # Qwen2-0.5B's widths
SMALL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=344, vocab_size=2000)


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def nvml_against_nvidia_smi() -> None:
    from services.agent.devices import nvidia_gpus

    devices, why = nvidia_gpus()
    if not devices:
        print(f"no NVIDIA GPU through NVML: {why}")
        return
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    for d, line in zip(devices, smi):
        index, name, free, total = (x.strip() for x in line.split(","))
        print(
            f"gpu {d.index} {name}: NVML free {d.free_mib:,} / total {d.total_mib:,} MiB; nvidia-smi free {free} / "
            f"total {total} MiB (free differs by {d.free_mib - int(free):+,} MiB)"
        )


def peak_flops() -> float | None:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)


def job(
    model_dir: Path,
    pairs: list[dict],
    device: str,
    steps: int,
    packing: bool,
    batch: int,
    seq: int,
    quantization: str = "none",
) -> dict:
    """One jetlora job in this process: real tokens/s after the first step, and its peak memory."""
    import io
    from contextlib import redirect_stdout

    import msgspec

    from schemas.events import Progress, TrainerEvent, TrainerSpec
    from schemas.jobs import JobRequest
    from trainer.job.loop import train

    precision = "bf16" if device == "cuda" else "fp32"
    req = msgspec.convert(
        {
            "model": "check",
            "base_dir": str(model_dir),
            "data": pairs,
            "quantization": quantization,
            "accelerator": "gpu" if device == "cuda" else "cpu",
            "lora": {"r": 16, "alpha": 32},
            "train": {
                "max_steps": steps,
                "batch_size": batch,
                "packing": packing,
                "max_seq_length": seq,
                "precision": precision,
                "logging_steps": 1,
                "warmup_steps": 0,
            },
        },
        JobRequest,
    )
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, write_through=True)  # kept: closing it (as collecting it does) closes raw
    with tempfile.TemporaryDirectory() as tmp, redirect_stdout(out):
        finished = train(TrainerSpec(job="check", attempt=1, request=req, out_dir=tmp, device=device))
        adapter = Path(tempfile.mkdtemp(prefix="jetlora-check-adapter-"))
        shutil.copytree(finished.adapter_dir, adapter, dirs_exist_ok=True)
    dec = msgspec.json.Decoder(TrainerEvent)
    progress = [
        e
        for e in (dec.decode(x) for x in raw.getvalue().decode().splitlines() if x.startswith("{"))
        if isinstance(e, Progress)
    ]
    first, last = progress[0], progress[-1]
    return {
        "tokens_per_s": (last.tokens - first.tokens) / (last.elapsed_s - first.elapsed_s),
        "loss": last.loss,
        "peak_mib": last.peak_mib,
        "adapter": adapter,
    }


def throughput(model_dir: Path, pairs: list[dict], device: str, steps: int, seq: int, params: int) -> Path:
    from bench.train_throughput import run_baseline

    peak = peak_flops() if device == "cuda" else None
    mean = 60
    results = {
        "packed": job(model_dir, pairs, device, steps, True, 4, seq),
        "padded": job(model_dir, pairs, device, steps, False, max(1, 4 * seq // mean), seq),
    }
    try:
        results["transformers.Trainer"] = run_baseline(
            model_dir, pairs, steps, 1e-3, max(1, 4 * seq // mean), seq, cpu=device != "cuda"
        )
    except Exception as e:  # the baseline's own failure is reported, not ours
        print(f"transformers.Trainer + peft did not run: {type(e).__name__}: {e}")
    for name, r in results.items():
        mfu = f", MFU {4 * params * r['tokens_per_s'] / peak:.1%} (4N flops a token: frozen base)" if peak else ""
        mem = f", peak {r['peak_mib']:,.0f} MiB" if r.get("peak_mib") else ""
        print(f"{name:22s} {r['tokens_per_s']:9,.0f} tok/s{mfu}{mem}, final loss {r['loss']:.3f}")
    return results["packed"]["adapter"]


def vllm_loads(model_dir: Path, adapter: Path, budget_s: float) -> None:
    venv = Path(tempfile.mkdtemp(prefix="vllm-venv-"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    try:
        subprocess.run([venv / "bin" / "pip", "install", "-q", "vllm"], check=True, timeout=budget_s)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"vLLM did not install in {budget_s:.0f} s: {e}")
        return
    code = (
        "import sys; from vllm import LLM, SamplingParams; from vllm.lora.request import LoRARequest\n"
        f"llm = LLM({str(model_dir)!r}, enable_lora=True, max_lora_rank=16, gpu_memory_utilization=0.3)\n"
        "out = llm.generate(['Question 1:'], SamplingParams(max_tokens=8, temperature=0), "
        f"lora_request=LoRARequest('check', 1, {str(adapter)!r}))\nprint('vLLM with the adapter:', out[0].outputs[0].text)"
    )
    subprocess.run([venv / "bin" / "python", "-c", code], check=False, timeout=max(30.0, budget_s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="on this machine's CPU, a small model, a few steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vllm", action="store_true", help="also try vLLM's CUDA build (a multi-GB install)")
    args = ap.parse_args()
    import torch

    from tinymodel import build

    started = time.monotonic()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run it where a GPU is lent, or --dry-run here")
    steps, seq, shape = (4, 256, SMALL) if args.dry_run else (args.steps, args.seq, HALF_B)
    section("NVML against nvidia-smi")
    nvml_against_nvidia_smi() if shutil.which("nvidia-smi") else print("no nvidia-smi here")
    pairs = make_pairs(2000)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "m", [f"{p['q']} {p['a']}" for p in pairs[:500]], init_range=0.02, **shape)
        params = sum(
            t.numel()
            for t in __import__("safetensors.torch", fromlist=["x"])
            .load_file(str(model_dir / "model.safetensors"))
            .values()
        )
        section(f"bf16 job, {params / 1e6:.0f}M parameters, rows of {seq} tokens, {steps} steps")
        from trainer.model import attention_for

        print(f"attention: {attention_for(device, torch.bfloat16)} (flash-attn: pip install -e '.[flash]')")
        adapter = throughput(model_dir, pairs, device, steps, seq, params)
        section("nf4 (bitsandbytes)")
        try:
            r = job(model_dir, pairs, device, steps, True, 4, seq, quantization="nf4")
            print(f"nf4 packed: {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_mib']:,.0f} MiB, loss {r['loss']:.3f}")
        except Exception as e:
            print(f"nf4 did not run: {type(e).__name__}: {e}")
        section("co-training: K = 8 jobs in one group against 8 trainer processes sharing the GPU (bf16)")
        co_train = [sys.executable, str(ROOT / "bench" / "co_train.py"), "--ks", "2" if args.dry_run else "8"]
        co_train += ["--rounds", "1" if args.dry_run else "3", "--steps", "2" if args.dry_run else "5"]
        if not args.dry_run:
            co_train += ["--device", "cuda", "--precision", "bf16", "--hidden", "1024", "--layers", "12", "--rows", "4"]
        subprocess.run(co_train, check=False, timeout=None if args.dry_run else 300)
        section("the memory estimate against torch.cuda.max_memory_allocated")
        flags = [] if args.dry_run else ["--cuda"]
        subprocess.run([sys.executable, str(ROOT / "bench" / "memory_estimate.py"), *flags], check=False)
        if args.vllm and not args.dry_run:
            section("vLLM (CUDA build) loads the adapter")
            vllm_loads(model_dir, adapter, budget_s=max(30.0, 420 - (time.monotonic() - started)))
    print(f"\ndone in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
