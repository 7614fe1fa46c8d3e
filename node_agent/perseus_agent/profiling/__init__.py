"""Measuring each computation's time and energy at a locked clock (the profile's rows).

Pure measurement over a GPU's energy counter: ``profiler`` follows a GPU through the clock
schedule and turns the training process's requests into rows; ``energy_sampler`` samples and
interpolates the counter. Imports only :mod:`perseus_agent.errors`.
"""
