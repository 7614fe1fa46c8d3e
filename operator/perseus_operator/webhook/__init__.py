"""The mutating admission webhook that connects a training pod to its node's agent.

Pure patch building (``injection``), its HTTPS server (``injection_server``) and that server's
bounds on connections and request time (``connection_limits``). May import
``workloads``; never ``jobs``, ``policies`` or the kopf adapters.
"""
