"""Serving the training processes: the local socket and the TCP listener.

Owns the listeners (``local_server``: the accept loop; ``tcp_server``), the serving of one
connection (``connection``), their socket file and connection bounds
(``socket_file``, ``socket_limits``) and the dispatch of a request to its handler
(``client_dispatch``). Transport only: it knows no GPU and no plan, and imports only
``errors`` and ``log_limit``.
"""
