"""The controller's pure cores: plain data in, decisions and commands out; no I/O, no clock.

The live controller (asyncio, HTTP, subprocesses) and the simulator (a virtual clock) drive
the same objects from here; nothing in this package may import an I/O module.
"""
