"""Who holds a GPU's clocks, and how they are given back.

Owns the guard against clocks someone else set (``clock_owners``) and the on-disk record of
what to reset after a crash (``reset_state``). May import only ``gpu`` and ``errors``.
"""
