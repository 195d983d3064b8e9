"""`python -m treetune.emulator --profile P | --world W <SGLang launch flags>`."""

from __future__ import annotations

import dataclasses
import errno
import socket
import sys

from aiohttp import web

from treetune.backends.sglang_adaptive import fallback_warning, initialized_line
from treetune.emulator.args import LaunchError, parse, warn_ignored
from treetune.emulator.server import EmulatedServer, log
from treetune.errors import TreetuneError
from treetune.perfmodel import PerfModel, check_memory, load_profile
from treetune.perfmodel.profile import with_attention_dp
from treetune.worlds import load_world


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        print(f"[emulator] ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        # A profile (or world) without an entry for the launch's draft method refuses here.
        if settings.world is not None:
            world = load_world(settings.world)
            if settings.attention_dp > 1:  # the server's groups, as its flags ask
                world = dataclasses.replace(world, profile=with_attention_dp(
                    world.profile, settings.attention_dp))
            profile, model = world.profile, world.model(settings.tp, method=settings.method)
        else:
            assert settings.profile is not None  # parse() wants one of the two
            profile = load_profile(settings.profile)
            if settings.attention_dp > 1:
                profile = with_attention_dp(profile, settings.attention_dp)
            model = PerfModel(profile, settings.tp, method=settings.method)
    except TreetuneError as exc:
        print(f"[emulator] ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    warn_ignored(settings)
    if settings.adaptive_fallback is not None:
        log(fallback_warning(settings.adaptive_fallback))  # and it serves static trees
    if settings.tp > profile.hardware.gpus:
        print(f"[emulator] ERROR: --tp-size {settings.tp} needs {settings.tp} GPUs but profile "
              f"'{profile.name}' has {profile.hardware.gpus} {profile.hardware.gpu}",
              file=sys.stderr, flush=True)
        return 1
    memory = check_memory(profile, settings.config, settings.max_running_requests,
                          tp=settings.tp, mem_fraction_static=settings.mem_fraction_static,
                          method=model.method)
    if not memory.starts:
        # SGLang's words when the weights leave no pool; a workspace outgrowing the rest
        # fails in CUDA-graph capture instead, where a larger share only makes it worse.
        advice = ("Not enough memory. Please try to increase --mem-fraction-static."
                  if memory.cause == "weights" else
                  "CUDA out of memory while capturing CUDA graphs: lower "
                  "--mem-fraction-static or --max-running-requests.")
        print(f"[emulator] ERROR: RuntimeError: {advice} ({memory.reason})", file=sys.stderr,
              flush=True)
        return 1
    # A pool too small for every running request's reserve: SGLang admits requests while
    # it has room and retracts them when it runs short, so about as many run at once as
    # it holds. Without --max-running-requests, that is how many it runs.
    running = memory.running(settings.max_running_requests)
    if not settings.max_running_requests_set:
        settings = dataclasses.replace(settings, max_running_requests=running)
    elif running < settings.max_running_requests:
        log(f"the KV pool holds {running} of the {settings.max_running_requests} running "
            f"requests asked for ({memory.reason}): the others wait, as SGLang admits "
            "requests while its pool has room and retracts them when it runs short")
    server = EmulatedServer(settings, profile, model, running)
    method = f" ({model.method_name})" if settings.method else ""
    speculation = (f"adaptive steps (sized for {settings.config})"
                   if settings.adaptive else f"speculative config {settings.config}{method}")
    log(f"emulating {settings.model_path} as profile '{profile.name}', {speculation}, max "
        f"running requests {settings.max_running_requests}, time scale "
        f"{settings.time_scale:g}")
    if server.engine.schedule is not None:
        log(initialized_line(server.engine.schedule))
    fields = ", ".join(f"{k}={v!r}" for k, v in server.server_args().items())
    log(f"server_args=ServerArgs({fields})")  # as SGLang logs it, secrets and all
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        # As uvicorn (SGLang) and aiohttp do: a relaunch on the same port must not wait for
        # the previous server's TIME_WAIT connections; a live listener still refuses the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        print(f"[emulator] ERROR: cannot bind {settings.host}:{settings.port}: {reason}",
              file=sys.stderr, flush=True)
        return 1
    web.run_app(server.app, sock=sock, print=None, handle_signals=True,
                shutdown_timeout=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
