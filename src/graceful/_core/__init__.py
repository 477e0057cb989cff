"""The core: the coordinator, its engine and policies, phases, deadlines, hooks, signals,
tracking, listeners, events, logging, the shape of a server's shutdown, health answers.

Nothing here imports a server package (a test checks it).
"""
