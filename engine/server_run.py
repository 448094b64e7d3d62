"""Starting ``dayzero serve``: load the engine as ``generate`` does, compile, listen, stop cleanly.

In a multi-process run every process loads and compiles; process 0 serves HTTP and the others
follow its steps (``server_mirror``)."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import time

import jax
import uvicorn


class ServeError(ValueError):
    """A ``dayzero serve`` setting that cannot work (a busy port)."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that a SIGINT/SIGTERM ends it with exit status 0: uvicorn
    re-raises a captured signal after its graceful shutdown (the process would then die of it);
    here the signal has done its job once the server has drained. ``on_signal`` runs first (the
    app stops admitting)."""

    on_signal = staticmethod(lambda: None)

    def handle_exit(self, sig, frame) -> None:
        self.on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (``port`` 0: a free one, which the announced URL names)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host") from None
    sock.listen(2048)
    return sock


def _size(value: str | None, flag: str) -> int | None:
    """A serve option's byte size (``4GiB``, ``500MB``, ``0``), None if not given."""
    if value is None:
        return None
    from dayzero.sharding.planner import PlanError, parse_size

    try:
        return 0 if value.strip() == "0" else parse_size(value)
    except PlanError:
        raise ServeError(f"{flag} {value!r} is not a size; write e.g. 4GiB, 500MB or 0") from None


def serving_config(args: argparse.Namespace):
    """The ``ServingConfig`` the serve options ask for (defaults: the engine's)."""
    from dayzero.engine.paged_steps import ServingConfig

    given = {"slots": args.slots, "page_size": args.page_size, "num_pages": args.num_pages,
             "max_context": args.max_context, "max_chunk": args.max_chunk, "state_snapshots": args.state_snapshots,
             "micro_batches": args.micro_batches}
    for flag, field in (("swap_space", "swap_bytes"), ("host_cache", "host_cache_bytes")):
        given[field] = _size(getattr(args, flag, None), "--" + flag.replace("_", "-"))
    if args.speculative is not None:  # as generate's (draft:DIR loads the draft model); serve has no --ngram
        from dayzero.engine.cli import speculative_config

        given["speculative"] = speculative_config(argparse.Namespace(**{**vars(args), "ngram": None}))
    elif args.num_draft_tokens is not None:
        raise ServeError("--num-draft-tokens sets speculative decoding; add --speculative ngram")
    return ServingConfig(**{k: v for k, v in given.items() if v is not None}, prefix_cache=not args.no_prefix_cache)


def run_serve(args: argparse.Namespace, placement) -> int:
    """``dayzero serve``: returns the exit status (0 after a signal's graceful stop)."""
    from dayzero.engine.server import ServerOptions, announce, create_app
    from dayzero.engine.server_mirror import LeaderServing, follow, ignore_signals

    leader = jax.process_index() == 0
    if not leader:
        ignore_signals()
    # Only process 0 listens; before loading and compiling, so a busy port fails fast.
    sock = _listen(args.host, args.port) if leader else None
    serving, grammars = _compiled_engine(args, placement)
    if jax.process_count() > 1:
        if not leader:
            steps = follow(serving, grammars)
            print(f"dayzero: serve: process {jax.process_index()} ran {steps} steps with process 0", file=sys.stderr)
            return 0
        serving = LeaderServing(serving)
    name = args.served_model_name or (args.model or "smollm2-135m-instruct")
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    options = ServerOptions(model_name=name, max_queue=args.max_queue, grammars=grammars,
                            on_ready=lambda: announce(url, name))
    app = create_app(serving, options)
    server = _Uvicorn(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                                     access_log=args.log_level == "debug"))
    server.on_signal = lambda: setattr(app.state.server, "draining", True)
    server.run(sockets=[sock])
    return 0


def _compiled_engine(args: argparse.Namespace, placement):
    """The serving engine (loaded as ``generate`` loads, every step shape compiled unless
    ``--no-warmup``) and its structured-output compiler (None without a tokenizer)."""
    from dayzero.engine.generate import Engine
    from dayzero.engine.runtime import options_from_args
    from dayzero.engine.serving import ServingEngine

    engine = Engine.load(args.model, placement=placement, **options_from_args(args))
    serving = ServingEngine(engine, serving_config(args))
    start = time.perf_counter()
    grammars = _grammars(engine)
    # Every variant a request can ask for: masks (structured output) and top logprobs too.
    constrained = grammars is not None and not grammars.unavailable
    shapes = 0 if args.no_warmup else serving.warmup(constrained=constrained, top_logprobs=True)
    print(f"dayzero: compiled {shapes} step shapes in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return serving, grammars


def _grammars(engine):
    """The structured-output compiler over the engine's tokenizer (None without one)."""
    if engine.tokenizer is None:
        return None
    from dayzero.engine.grammar import Grammars

    grammars = Grammars(engine.tokenizer, engine.config.vocab_size, engine.eos_ids)
    if grammars.unavailable:
        print(f"dayzero: structured output is off: {grammars.unavailable}", file=sys.stderr, flush=True)
    return grammars
