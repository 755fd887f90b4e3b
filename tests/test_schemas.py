"""The committed JSON Schemas and AsyncAPI document are what `jetlora schema` writes now."""

from schemas import export, names


def test_committed_schema_files_are_current():
    stale = [
        rel
        for rel, text in export.rendered().items()
        if not (export.HERE / rel).exists() or (export.HERE / rel).read_text() != text
    ]
    assert not stale, f"run `jetlora schema` and commit: {stale}"


def test_every_subject_is_in_the_asyncapi_document():
    doc = export.asyncapi()
    addresses = {c["address"] for c in doc["channels"].values() if c["address"]}
    for subject in (
        names.SUBMIT,
        names.CANCEL,
        names.STOP,
        names.GET_JOB,
        names.LIST_JOBS,
        names.LIST_NODES,
        names.ARTIFACTS_LIST,
        names.ARTIFACTS_DELETE,
        names.node("{node}").heartbeat,
        names.job("{job}", "{node}").progress,
    ):
        assert subject in addresses
