"""The HTTP side: the app, its routes, admission, auth, connections, request bodies, SSE and the
wire formats. It reaches the engine through its facade and the values of `core/messages.py`."""
