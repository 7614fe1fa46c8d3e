"""What the tests share: fakes, harnesses and the real servers they start (one module each).

Importable as ``support.<module>`` (pytest puts ``tests/`` on ``sys.path``); type-checked with
the product (``make typecheck``).
"""
