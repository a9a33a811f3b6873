"""The recording API's implementation (public names are re-exported by `replay`).

    options.py     what run.step(...) was told (recorded in the manifest)
    taps.py        replay.tap: fingerprint a tree the step computes
    hashing.py     per-example batch hashes, on the host
    program.py     the user's step and its record, traced into one program; the schema
    packed.py      the record as one uint32 vector (one buffer to fetch a step)
    fingerprint.py device-side tensor fingerprints (traces/fingerprint.py is the reference)
    recorder.py    records fetched one step late and appended to the trace
    at_exit.py     a run the program exits without finishing: its records in flight written
    environment.py the environment and program hash a manifest records
    orbax_io.py    checkpoint errors and orbax's quieting, shared with the trainer
    step.py        run.step: the wrapper while recording (records fetched one step late)
    checkpoints.py orbax checkpoints with state fingerprints
    manifest.py    what replay.init writes into run.json
    run.py         replay.init and the run it returns
    loop.py        replay.Loop and @replay.entrypoint: the replay side
    replayable.py  the engine's protocol for API-recorded runs
"""
