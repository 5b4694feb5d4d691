"""The api service: the HTTP/WebSocket edge (stateless; scale by running more)."""
