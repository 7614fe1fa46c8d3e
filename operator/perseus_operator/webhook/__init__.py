"""The mutating admission webhook that connects a training pod to its node's agent.

Pure patch building (``injection``) and its HTTPS server (``injection_server``). May import
``workloads``; never ``jobs``, ``policies`` or the kopf adapters.
"""
