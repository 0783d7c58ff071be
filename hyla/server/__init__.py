"""hyla's HTTP server: an OpenAI-compatible API and SGLang's native ``/generate`` over one Engine.

    hyla serve --model PATH            # cli.py: flags generated from EngineArgs
    app = create_app(PATH, **options)  # app.py: the FastAPI app (endpoints, errors, streaming)

protocol.py holds the request/response models, metrics.py the prometheus registry, launch.py
``BackgroundServer`` (the server on a thread of the calling process). See docs/server.md.
"""
