"""The Tinker API's flags, the same on `jetlora gateway` and `jetlora up --gateway-port`: how long a session may sit
idle or silent before its device is freed, how long a finished session's records are kept, and a tenant's bounds."""

from __future__ import annotations

import argparse

from services.gateway.tinker.settings import TinkerSettings
from services.runtime import StartupError

DEFAULTS = TinkerSettings()


def tinker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tinker-idle-s",
        type=float,
        default=DEFAULTS.idle_s,
        help=f"a Tinker API training session with no call this long is checkpointed and its device freed; the next "
        f"call resumes it (10 s at least; default {DEFAULTS.idle_s:g})",
    )
    p.add_argument(
        "--tinker-silence-s",
        type=float,
        default=DEFAULTS.silence_s,
        help=f"a Tinker session whose client sent no heartbeat this long (it sends one every 10 s: a client killed "
        f"or cut off) is paused the same way, its device freed (default {DEFAULTS.silence_s:g})",
    )
    p.add_argument(
        "--tinker-retention-s",
        type=float,
        default=DEFAULTS.retention_s,
        help=f"a finished Tinker session's records (its models, samplers and calls) are deleted this long after it "
        f"finished (default {DEFAULTS.retention_s:g}; the adapters its jobs stored are kept as any job's)",
    )
    p.add_argument(
        "--tinker-max-sessions",
        type=int,
        default=DEFAULTS.max_sessions,
        help=f"Tinker sessions per tenant, from create_session until finished (default {DEFAULTS.max_sessions})",
    )
    p.add_argument(
        "--tinker-max-models",
        type=int,
        default=DEFAULTS.max_models,
        help=f"Tinker training models and base samplers per tenant (default {DEFAULTS.max_models})",
    )
    p.add_argument(
        "--tinker-max-sampler-saves",
        type=int,
        default=DEFAULTS.max_sampler_saves,
        help=f"named Tinker sampler saves per tenant, kept in the object store until deleted or their TTL passes "
        f"(default {DEFAULTS.max_sampler_saves})",
    )


def tinker_settings(args: argparse.Namespace) -> TinkerSettings:
    settings = TinkerSettings(
        idle_s=args.tinker_idle_s,
        silence_s=args.tinker_silence_s,
        retention_s=args.tinker_retention_s,
        max_sessions=args.tinker_max_sessions,
        max_models=args.tinker_max_models,
        max_sampler_saves=args.tinker_max_sampler_saves,
    )
    problems = settings.problems() + [
        f"--tinker-max-{what} {n}: give 1 or more"
        for what, n in (
            ("sessions", settings.max_sessions),
            ("models", settings.max_models),
            ("sampler-saves", settings.max_sampler_saves),
        )
        if n < 1
    ]
    if problems:
        raise StartupError("; ".join(problems))
    return settings
