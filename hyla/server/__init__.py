"""hyla's HTTP server: an OpenAI-compatible API and SGLang's native ``/generate`` over one Engine.

    hyla serve --model PATH            # cli.py: flags generated from EngineArgs
    app = create_app(PATH, **options)  # app.py: the FastAPI app

One file per idea: ``app.py`` (the app factory, ``Server``, /health, /metrics), ``openai_routes.py``
(/v1/*), ``native_routes.py`` (/generate), ``generation.py`` (one request's engine requests, run,
streamed and aborted together), ``errors.py`` (OpenAI-style error bodies and statuses),
``protocol.py`` (request/response models), ``metrics.py`` (prometheus), ``front_door.py`` (the
thread that accepts connections and answers health checks without the event loop), ``launch.py``
(``UvicornServer``; ``BackgroundServer``: the server on a thread of the calling process), ``cli.py``.
See docs/server.md.
"""
