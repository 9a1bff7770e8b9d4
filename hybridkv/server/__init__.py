"""``hybridkv serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn + prometheus-client, the ``server``
extra) over ``AsyncLLM``. ``protocol`` holds the request and response bodies, ``app`` the routes, ``metrics``
the Prometheus metrics and the stats log line, ``cli`` the command. Importing this package imports none of
the server's dependencies."""
