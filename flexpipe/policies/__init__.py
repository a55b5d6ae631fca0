"""Pure decision policies: snapshot + `now` + a seeded `random.Random` in, decision out.

No I/O, no wall clock, no global RNG: the gateway and the simulator run the same code.
"""
