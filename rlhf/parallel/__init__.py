"""Distributed runtime: layouts, role meshes, collectives, watchdog."""
