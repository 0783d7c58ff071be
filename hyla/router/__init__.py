"""hyla's router: one address in front of data-parallel ``hyla serve`` workers, routing each request
to the worker whose prefix cache most likely holds its prompt.

    hyla route --worker-urls http://gpu0:30000 http://gpu1:30000    # cli.py
    hyla serve --model M --device cuda --dp-size 2                   # launch.py: workers + router
    app = create_router_app(urls)                                    # app.py: the FastAPI app

``policy.py`` (which worker: cache-aware, round robin, least load, random), ``app.py`` (forwarding,
health, the router's own endpoints), ``cli.py``, ``launch.py`` (``hyla serve --dp-size``). Only HTTP between the router and its workers: it
imports neither the engine nor torch. See docs/server.md, "Data parallelism: hyla route".
"""
