"""The datasets bucket's read side, as any service or client reads it: a dataset by its object name, and a name as a
tenant sees it (the rules are the stored format's: schemas/object_headers.py)."""

from __future__ import annotations

from nats.js.errors import NotFoundError

from schemas import names
from schemas.datasets import DatasetInfo
from schemas.object_headers import dataset_from_object, dataset_lookups, visible_to


async def find_dataset(js, name: str) -> DatasetInfo | None:
    """The dataset stored under object name `name` (names.dataset_object), or None."""
    obs = await js.object_store(names.DATASETS_BUCKET)
    try:
        return dataset_from_object(await obs.get_info(name))
    except NotFoundError:
        return None


async def visible_dataset(js, name: str, tenant: str | None) -> DatasetInfo | None:
    """The dataset `name` as `tenant` sees it: its own first, else an admin's shared with it (an admin: the
    admins' own). None when there is none it may see: another tenant's is not there for it."""
    for stored in dataset_lookups(name, tenant):
        if visible_to(found := await find_dataset(js, stored), tenant):
            return found
    return None
