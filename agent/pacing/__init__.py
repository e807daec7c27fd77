"""Pacing: keep training under the board's thermal target and power cap.

``controller`` (decisions, states, clock, PI loop), ``governor`` (the PI governor and its
config), ``power_modes`` (which nvpmodel mode to run), ``hook`` (the trainer hook that sleeps
between steps), ``report`` (the job report with pacing over time).
"""
