"""Where a training session keeps what it saved, laid out so one checkpoint carries all of it: `current/` (the
adapter and optimizer to go on from, the gradients not yet stepped and the calls applied: trainer/session/applied_calls.py),
`states/<name>/` (each save_state) and `sampler/<name>/` (the latest unnamed sampler saves, PEFT's layout). The
agent stores the whole directory as the job's checkpoint at every save_state and pause, so a session resumed after
idling, or moved after its node died, still loads and samples what it saved before. Named sampler saves are not
in it: each goes to the object store on its own (schemas/sessions.py stored_sampler), so a session's checkpoint,
memory and resume stay the same size however many it makes."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from schemas.sessions import SNAPSHOTS_KEPT


class SessionStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.current = root / "current"

    def state(self, name: str) -> Path:
        return self.root / "states" / name

    def sampler(self, name: str) -> Path:
        return self.root / "sampler" / name

    def keep_current(self, name: str) -> None:
        """The state just saved as `name` is also where the session goes on from."""
        shutil.rmtree(self.current, ignore_errors=True)
        shutil.copytree(self.state(name), self.current)

    def restore(self, bundle: Path) -> None:
        """Take the saves of a stored checkpoint (the session's own, from an earlier attempt) back in."""
        for part in ("current", "states", "sampler"):
            if (bundle / part).is_dir():
                shutil.copytree(bundle / part, self.root / part, dirs_exist_ok=True)

    def samplers(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every sampler save on disk, as the weights to swap in (PEFT's names, as get_peft_model_state_dict)."""
        from safetensors.torch import load_file

        found = {}
        for path in sorted((self.root / "sampler").glob("*/adapter_model.safetensors")):
            found[path.parent.name] = load_file(str(path))
        return found

    def forget(self, name: str, kind: str) -> bool:
        """A save the client deleted: its files go (the next checkpoint no longer carries it)."""
        path = self.state(name) if kind == "state" else self.sampler(name)
        found = path.is_dir()
        shutil.rmtree(path, ignore_errors=True)
        return found

    @staticmethod
    def forget_stored(path: Path) -> bool:
        """A stored sampler save's local copy (the object store's goes by the gateway's hand)."""
        found = path.is_dir()
        shutil.rmtree(path, ignore_errors=True)
        return found

    def prune(self, snapshots: dict) -> None:
        """Only the last SNAPSHOTS_KEPT unnamed sampler saves stay (an RL loop makes one every step)."""
        unnamed = [name for name in snapshots if name.startswith("snapshot-")]
        for name in unnamed[:-SNAPSHOTS_KEPT]:
            del snapshots[name]
            shutil.rmtree(self.sampler(name), ignore_errors=True)
