"""The gateway's pure cores: plain data in, decisions out; no I/O, no clock.

The live gateway (HTTP on asyncio) and the simulator's gateway (a virtual clock) call the
same functions from here; nothing in this package may import an I/O module.
"""
