"""Train/serve parity without an engine: the trainer stores the probe set's per-token log-probabilities with the
adapter's probe, equal to a direct PEFT forward of the saved adapter (and of the base model alone); they travel
with the artifact into the registry's version; probes and statuses stored before parity still load; the verdict's
arithmetic. The engines' side is tested against real engines: tests/test_parity_engines.py."""

from __future__ import annotations

import msgspec
import torch

from schemas.job_status import ArtifactRef, Probe
from schemas.parity import PARITY_TEXTS, ParityFigures, ParityText, deltas, describe, figures
from schemas.registry import DECODERS, AdapterReply, Alias, AdapterVersion, NodeAdapterStatus, StoredFile
from services.cli.adapters import describe as describe_adapter
from tests.conftest import spec_for
from trainer.job.loop import train
from trainer.model import load


def direct_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]), i >= 1, from one plain forward: what the trainer's figures must equal."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_the_probe_set_log_probs_are_the_saved_adapters_and_the_bases(tiny_model, tmp_path):
    from peft import PeftModel

    finished = train(spec_for(tiny_model, tmp_path, max_steps=12))
    assert finished.state == "trained" and finished.probe is not None and finished.probe.parity is not None
    texts = finished.probe.parity
    assert [t.prompt.removeprefix("<s>") for t in texts] == list(PARITY_TEXTS)

    tok, base = load(str(tiny_model), "cpu", torch.float32)
    for t in texts:
        assert t.bos and t.ids[0] == tok.bos_token_id and t.ids[1:] == tok(t.prompt.removeprefix("<s>"))["input_ids"]
        assert len(t.adapter) == len(t.base or []) == len(t.ids) - 1 >= 16
        assert max(deltas(t.base or [], direct_logprobs(base, t.ids))) < 1e-6
    served = PeftModel.from_pretrained(base, finished.adapter_dir)
    worst, moved = 0.0, 0.0
    for t in texts:
        theirs = direct_logprobs(served, t.ids)
        worst = max(worst, *deltas(t.adapter, theirs))
        moved = max(moved, *deltas(t.base or [], theirs))
    print(f"trainer vs direct PEFT forward: max |Δ log p| {worst:.2e}; the adapter moved them by up to {moved:.2f}")
    assert worst < 1e-6 and moved > 0.1


def test_parity_travels_with_the_artifact_and_older_records_still_load():
    text = ParityText(prompt="<s>Hi there", ids=[1, 5, 6], bos=True, adapter=[-1.5, -0.25], base=[-2.0, -0.5])
    probe = Probe(prompt="Hello", text=" x", head=" x", dtype="float32", parity=[text])
    ref = msgspec.json.decode(msgspec.json.encode(ArtifactRef("peft", "j/peft", 1, "0" * 64, probe)), type=ArtifactRef)
    assert ref.probe == probe  # what the registry copies into the version it registers
    file = StoredFile(name="j/peft", sha256="0" * 64, size=1)
    version = AdapterVersion(
        name="a",
        version=1,
        job="j",
        base_model="tiny",
        peft=file,
        r=8,
        alpha=16,
        target_modules=["q_proj"],
        probe=probe,
    )
    assert DECODERS["version"].decode(msgspec.json.encode(version)).probe == probe

    older = msgspec.structs.replace(version, probe=Probe(prompt="Hello", text="a", head="a", dtype="float32"))
    old = msgspec.json.encode(older).replace(b',"parity":null', b"")  # as stored before parity
    assert b"parity" not in old and DECODERS["version"].decode(old) == older
    status = NodeAdapterStatus(name="a", version=1, node="n", engine="vllm u", state="loaded")
    stored = msgspec.json.encode(status).replace(b',"parity":null', b"")
    assert b"parity" not in stored and DECODERS["node"].decode(stored) == status


def test_the_verdict_is_the_mean_against_a_multiple_of_the_floor():
    good = figures([0.001, 0.003], [0.002, 0.002], factor=3.0, epsilon=0.01)
    assert good.within is True and good.limit == 3.0 * 0.002 + 0.01 and good.mean == 0.002 and good.max == 0.003
    bad = figures([0.05, 0.07], [0.002, 0.002], factor=3.0, epsilon=0.01)
    assert bad.within is False and bad.tokens == 2
    unjudged = figures([0.5], None, factor=3.0, epsilon=0.01)
    assert unjudged.within is None and unjudged.limit is None and "not judged" in unjudged.note
    assert deltas([-1.0, -2.0, -3.0], [None, -2.5, -3.0]) == [0.5, 0.0]
    assert "limit 0.016" in describe(good) and "max 0.07" in describe(bad)

    status = NodeAdapterStatus(name="a", version=2, node="n1", engine="vllm u", state="mismatch", parity=bad)
    lines = describe_adapter(AdapterReply(alias=Alias(name="a", current=2, latest=2), versions=[], nodes=[status]))
    assert any("parity @2" in line and "BEYOND" in line and "floor 0.002" in line for line in lines), lines
    assert isinstance(bad, ParityFigures)
