def sub(p, old, new, count=1):
    s=open(p).read()
    assert old in s, (p, old)
    s=s.replace(old,new,count); open(p,'w').write(s)
p='pytgi/server/launcher.py'
s=open(p).read()
a=s.index('FLAGS: list[tuple[str, type, object, str]] = [')
b=s.index('def _is_bind_address(value: str) -> bool:')
s=s[:a]+s[b:]
a=s.index('def _add_flags(p: argparse.ArgumentParser')
b=s.index('def _resolve_model(')
s=s[:a]+'''def _from_env(s: Setting) -> object:
    """A setting's value from its environment variable; HOSTNAME only when it is an address."""
    env = os.environ.get(s.env)
    if s.name == "hostname" and env is not None and not _is_bind_address(env):
        # Docker and Kubernetes set HOSTNAME to the container's name: not an address to bind
        IGNORED_ENV.append(
            f"HOSTNAME={env!r} is not an IP address (a container's name?): ignored; "
            "pass --hostname to choose the address to listen on"
        )
        return s.default
    return s.from_env()


'''+s[b:]
a=s.index('def add_serve_arguments(p: argparse.ArgumentParser) -> None:')
b=s.index('def _raise_open_files_limit() -> None:')
s=s[:a]+'''def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, env=_from_env)


SHARD_SETTINGS = ("model", "revision", "dtype", "quantize", "master_addr", "master_port", "batch_invariant")


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    """The flags a rank > 0 shares with rank 0's `pytgi serve` (give the same values), and its place."""
    settings.add_arguments(p, only=SHARD_SETTINGS, env=_from_env)
    p.add_argument(
        "--rank", type=int, default=int(os.environ.get("RANK", "0")), help="this rank, >= 1 [env RANK]"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="all ranks, rank 0 included [env WORLD_SIZE]",
    )


'''+s[b:]
s=s.replace('''    model = _resolve_model(log, args.model_id, args.revision)
    if model is None:
        return 2
    config = EngineConfig(
        model=str(model.path),
        dtype=args.dtype,
        quantize=args.quantize,
        num_shard=args.world_size,
        batch_invariant=not args.disable_batch_invariance,
        master_addr=args.master_addr,
        master_port=args.master_port or 29500,
    )''','''    model = _resolve_model(log, args.model, args.revision)
    if model is None:
        return 2
    config = EngineConfig(**settings.from_args(args, "engine"))
    config = dataclasses.replace(
        config, model=str(model.path), num_shard=args.world_size, master_port=config.master_port or 29500
    )''')
s=s.replace('''    from pytgi.config import EngineConfig
    from pytgi.server.app import ServerConfig, create_app''','''    from pytgi.config import EngineConfig, ServerConfig
    from pytgi.server.app import create_app''')
s=s.replace('''    exempt = tuple(e.strip() for e in args.api_key_exempt.split(",") if e.strip() and e.strip() != "none")''','''    exempt = tuple(e for e in args.api_key_exempt if e != "none")''')
s=s.replace('''    model = _resolve_model(log, args.model_id, args.revision, progress)
    draft = _resolve_model(log, args.draft_model_id, progress=progress) if args.draft_model_id else None
    if model is None or (args.draft_model_id and draft is None):
        return 2''','''    model = _resolve_model(log, args.model, args.revision, progress)
    draft = _resolve_model(log, args.draft_model, progress=progress) if args.draft_model else None
    if model is None or (args.draft_model and draft is None):
        return 2''')
a=s.index('    engine = EngineConfig(\n        model=str(model_path),')
b=s.index('    app = create_app(config)')
s=s[:a]+'''    engine = dataclasses.replace(
        EngineConfig(**settings.from_args(args, "engine")),
        model=str(model_path),
        draft_model=str(draft.path) if draft else None,
        num_shard=args.num_shard,
    )
    config = ServerConfig(
        engine=engine,
        model_path=model_path,
        model_id=model_id,
        **{**settings.from_args(args, "server"), "api_key_exempt": exempt},
        model_sha=model.sha or args.revision,
        engine_module=engine_module,
    )
'''+s[b:]
s=s.replace('''            host=args.hostname,
            port=args.port,''','''            host=config.hostname,
            port=config.port,''')
s=s.replace('''            http=with_header_timeout(args.request_header_timeout),''','''            http=with_header_timeout(config.request_header_timeout),''')
s=s.replace('''            timeout_graceful_shutdown=args.graceful_termination_timeout,''','''            timeout_graceful_shutdown=config.graceful_termination_timeout,''')
s=s.replace('''            timeout_keep_alive=args.keep_alive_timeout,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,''','''            timeout_keep_alive=config.keep_alive_timeout,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,''')
s=s.replace('''from pytgi.logs import JSON_ENV, setup_logging
''','''from pytgi import settings
from pytgi.logs import JSON_ENV, setup_logging
from pytgi.settings import Setting
''')
s=s.replace('import asyncio\n','import asyncio\nimport dataclasses\n')
open(p,'w').write(s)
p='pytgi/server/tgi.py'
sub(p,'''    st = state_of(request)
    cfg, eng = st.config, st.client.info
    assert eng is not None
    return JSONResponse(
        {
            "model_id": cfg.model_id,
            "model_sha": cfg.model_sha,
            "model_dtype": eng.model_dtype,
            "model_device_type": eng.model_device_type,
            "model_quantization": eng.quantization,  # pytgi's: a GGUF file's tensor types and counts
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": cfg.max_concurrent_requests,
            "max_best_of": cfg.max_best_of,
            "max_stop_sequences": cfg.max_stop_sequences,
            "max_input_tokens": eng.max_input_tokens,
            "max_total_tokens": eng.max_total_tokens,
            "max_input_length": eng.max_input_tokens,
            "waiting_served_ratio": eng.waiting_served_ratio,
            "max_batch_total_tokens": eng.max_batch_total_tokens,
            "max_waiting_tokens": eng.max_waiting_tokens,
            "max_batch_size": eng.max_batch_size,
            "max_batch_prefill_tokens": eng.max_batch_prefill_tokens,
            "validation_workers": cfg.validation_workers,
            "max_client_batch_size": 4,
            "num_shard": eng.num_shard,
            "router": "pytgi",
            "version": pytgi.__version__,
            "sha": None,
            "docker_label": None,
        }
    )''','''    st = state_of(request)
    cfg, eng = st.config, st.client.info
    assert eng is not None
    # The settings marked for /info (pytgi.settings), as the engine resolved them.
    resolved = {s.name: getattr(eng if s.reader == "engine" else cfg, s.name) for s in INFO_SETTINGS}
    return JSONResponse(
        {
            "model_id": cfg.model_id,
            "model_sha": cfg.model_sha,
            "model_dtype": eng.model_dtype,
            "model_device_type": eng.model_device_type,
            "model_quantization": eng.quantization,  # pytgi's: a GGUF file's tensor types and counts
            "model_pipeline_tag": "text-generation",
            **resolved,
            "max_input_length": eng.max_input_tokens,  # TGI's older name
            "max_client_batch_size": 4,
            "router": "pytgi",
            "version": pytgi.__version__,
            "sha": None,
            "docker_label": None,
        }
    )''')
s=open(p).read()
i=s.index('\n@router.get("/info"')
s=s[:i]+'\nINFO_SETTINGS = [s for s in settings.table() if s.info]\n'+s[i:]
s=s.replace('import pytgi\n','import pytgi\nfrom pytgi import settings\n',1)
open(p,'w').write(s)
p='pytgi/server/state.py'
s=open(p).read()
a=s.index('@dataclass(slots=True)\nclass ServerConfig:')
b=s.index('@dataclass(slots=True)\nclass State:')
s=s[:a]+s[b:]
s=s.replace('from pytgi.config import EngineConfig\n','from pytgi.config import ServerConfig\n')
open(p,'w').write(s)
p='pytgi/server/app.py'
s=open(p).read()
s=s.replace('from pytgi.server.state import ServerConfig, State\n','from pytgi.config import ServerConfig\nfrom pytgi.server.state import State\n')
open(p,'w').write(s)
p='pytgi/cli.py'
sub(p,'''    dl.add_argument(
        "--revision", default=_env("REVISION"), help="a branch, tag or commit (default: main) [env REVISION]"
    )
    dl.add_argument(
        "--json-output",
        action="store_true",
        default=_env("JSON_OUTPUT", "") not in ("", "0", "false"),
        help="log each file as a JSON line instead of progress bars [env JSON_OUTPUT]",
    )''','''    settings.add_arguments(dl, only=("revision", "json_output"))''')
sub(p,'''    gen.add_argument(
        "--model-id", default=_env("MODEL_ID"), help="Hub id, HF directory or .gguf (default: embedded)"
    )
    gen.add_argument("--revision", default=_env("REVISION"), help="of a Hub id (default: main)")
    gen.add_argument("--dtype", default=_env("DTYPE", "auto"))
''','''    settings.add_arguments(gen, only=("model", "revision", "dtype", "max_batch_total_tokens"))
''')
sub(p,'''    gen.add_argument("--max-batch-total-tokens", type=int, default=None)
''','')
sub(p,'''        model=args.model_id,''','''        model=args.model,''')
s=open(p).read()
s=s.replace('    from pytgi.server.launcher import add_serve_arguments, add_shard_arguments\n','    from pytgi import settings\n    from pytgi.server.launcher import add_serve_arguments, add_shard_arguments\n')
open(p,'w').write(s)
