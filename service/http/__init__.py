"""How a request gets in, before a route runs.

- ``protocol.py``: uvicorn's httptools protocol with connection limits (header and keep-alive timeouts,
  connections per worker), and the hooks that answer small hot-route requests in its own callback.
- ``direct.py``: which requests a connection answers itself, and how (``DirectAnswers``).
- ``fastpath.py``: the hot routes without FastAPI's per-request machinery (``FastRoutes``).
- ``middleware.py``: the ASGI middlewares of every other request (metrics, body limits, in-flight limit).
- ``admission.py``: the one set of rules both ways in apply (``Admission``: body limits, bodies held,
  in-flight slots, request metrics, unexpected errors).
"""
