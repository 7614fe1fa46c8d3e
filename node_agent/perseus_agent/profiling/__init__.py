"""Measuring each computation's time and energy at a locked clock (the profile's rows).

Pure measurement over a GPU's energy counter; imports only :mod:`perseus_agent.errors`.
"""
