"""The replay engine: what re-runs a recorded run and compares it, whatever loop recorded it.

    replay/engine/protocol.py         the loop protocol: what commands need from a loop, and `load`
    replay/engine/code.py             which code replay may import and call, and calling it
    replay/engine/replayer.py         a run's replayable behind a cache; state fingerprints, search
    replay/engine/engine.py           `replay run`'s core: check a range, re-run it, compare with the trace
    replay/engine/contract.py         the determinism contract: when bits are promised across machines
    replay/engine/damage.py           a run's damage and its name, for people
    replay/engine/recompute.py        a step recomputed with every intermediate by name (refine)
    replay/engine/tensor_distance.py  how far two recomputed tensors are, in their dtype's units
    replay/engine/noise.py            the noise floor of a change of machine or framework

Nothing here imports the commands (replay/cli/) or any loop (trainer/): a loop is reached
through its run's manifest and the protocol.
"""
